"""Request bodies that do not parse as the method's protobuf message.

grpc.aio deserializes a request before any handler or interceptor code runs; a ``DecodeError`` there
is answered UNKNOWN ("Unexpected <class 'DecodeError'>") with one ERROR traceback per request, and never
reaches the metrics. So the interceptor registers every method with a ``tolerant`` deserializer: it
hands the handler a ``Malformed`` marker instead of raising, and the handler answers INVALID_ARGUMENT
"malformed request", counts it, and reports it through ``recpipe.serving.outcomes`` (one line per
interval with a count, never a traceback: a client sending garbage must not be able to flood the log).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The status message of every malformed request.
MESSAGE = "malformed request"


class Malformed:
    """What a tolerant deserializer returns for bytes that are not the expected message."""

    __slots__ = ("error", "size")

    def __init__(self, error: Exception, size: int) -> None:
        self.error = error
        self.size = size

    def describe(self) -> str:
        """What the log says of it: its size and why it did not parse."""
        return f"{self.size} bytes ({type(self.error).__name__}: {str(self.error)[:200]})"


def tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer`` returning ``Malformed`` instead of raising (None stays None: raw bytes)."""
    if deserializer is None:
        return None
    parse = deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as e:  # DecodeError, or whatever a custom deserializer raises on bad bytes
            return Malformed(e, len(data))

    return deserialize

