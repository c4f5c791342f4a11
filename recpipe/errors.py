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
    """A downstream call was cancelled (gRPC CANCELLED): kept as such across hops, never INTERNAL."""


class DeadlineExceeded(RecpipeError):
    """The caller's deadline passed before the work was done (gRPC DEADLINE_EXCEEDED)."""
