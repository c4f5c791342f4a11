"""The one table between recpipe's domain errors and gRPC status codes, used in both directions.

Servers turn a raised ``RecpipeError`` into a status code (``code_for``); clients and the gateway turn a
status code from a peer back into the domain error (``error_for``), so an error keeps its meaning across
every hop.
"""

from __future__ import annotations

import grpc

from recpipe.errors import (
    ArtifactMismatch,
    BadRequest,
    Cancelled,
    DeadlineExceeded,
    Overloaded,
    RecpipeError,
    StageUnavailable,
    UnknownUser,
    UsageError,
)

#: Most specific first: the first class an exception is an instance of decides its code.
ERROR_CODES: tuple[tuple[type[RecpipeError], grpc.StatusCode], ...] = (
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (UsageError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownUser, grpc.StatusCode.NOT_FOUND),
    (ArtifactMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StageUnavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Cancelled, grpc.StatusCode.CANCELLED),
)

_ERRORS_BY_CODE: dict[grpc.StatusCode, type[RecpipeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: BadRequest,
    grpc.StatusCode.NOT_FOUND: UnknownUser,
    grpc.StatusCode.FAILED_PRECONDITION: ArtifactMismatch,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: StageUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def code_for(error: BaseException) -> grpc.StatusCode:
    """The status code a server answers with when ``error`` escapes a handler (INTERNAL if not ours)."""
    for cls, code in ERROR_CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


class RemoteError(RecpipeError):
    """A peer answered with a status that has no domain meaning (INTERNAL, UNKNOWN, ...)."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


def error_for(code: grpc.StatusCode, message: str) -> RecpipeError:
    """The domain error for a status a peer answered with; ``message`` should name the peer."""
    cls = _ERRORS_BY_CODE.get(code)
    if cls is None:
        return RemoteError(f"{message} ({code.name})", code)
    return cls(message)
