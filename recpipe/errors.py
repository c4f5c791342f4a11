"""Domain errors. One server interceptor maps these to gRPC status codes; the CLI maps them to exit codes.

Never raise bare ``Exception``/``assert`` on user input: raise one of these with a message a user can act on.
"""

from __future__ import annotations


class RecpipeError(Exception):
    """Base class of every error recpipe raises on purpose."""


class UsageError(RecpipeError):
    """A bad command-line argument or configuration value (CLI exit code 2)."""


class BadRequest(RecpipeError):
    """A request that can never succeed as sent (gRPC INVALID_ARGUMENT)."""


class MalformedRequest(BadRequest):
    """A message of a stream whose bytes are not the method's message (gRPC INVALID_ARGUMENT "malformed
    request"). The interceptor counts it where it finds it, in the request iterator; raised from there, it
    ends the stream once the handler has written what it was writing (``recpipe.serving.interceptor``)."""


class UnknownUser(RecpipeError):
    """The user id is not in the dataset (gRPC NOT_FOUND)."""


class ArtifactMismatch(RecpipeError):
    """A model-repository or dataset file is missing, corrupt, or does not belong with the others.

    The message names the offending file (gRPC FAILED_PRECONDITION at serve time).
    """


class Overloaded(RecpipeError):
    """The service is at capacity (gRPC RESOURCE_EXHAUSTED)."""


class StageUnavailable(RecpipeError):
    """A downstream stage could not be reached (gRPC UNAVAILABLE); the message names the stage."""


class Cancelled(RecpipeError):
    """A call was cancelled by its caller (gRPC CANCELLED), never INTERNAL. The gateway answers a stage's
    CANCELLED as ``StageUnavailable``: a stage cancels the calls it had not taken up as it stops."""


class SenderFailed(RecpipeError):
    """A query generator's sender process failed or died; the message names it (CLI exit code 1)."""


class DeadlineExceeded(RecpipeError):
    """The caller's deadline passed before the work was done (gRPC DEADLINE_EXCEEDED)."""


#: Client input quoted in an error message is cut to this many characters.
ECHO_LIMIT = 200


def clip(value: object, limit: int = ECHO_LIMIT) -> str:
    """``value`` as text of at most ``limit`` characters, then "... (N chars)" when it was longer.

    Every message that quotes what a client sent goes through this: an unbounded echo (a 200,000-character
    dtype) would push the gRPC status past the 16 KiB metadata limit and turn INVALID_ARGUMENT into
    RESOURCE_EXHAUSTED on the client's side.
    """
    text = str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"
