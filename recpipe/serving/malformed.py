"""Request bodies that do not parse as the method's protobuf message.

grpc.aio deserializes a request before any handler or interceptor code runs; a ``DecodeError`` there
is answered UNKNOWN ("Unexpected <class 'DecodeError'>") with one ERROR traceback per request, and never
reaches the metrics. So the interceptor registers every method with a ``tolerant`` deserializer: it
hands the handler a ``Malformed`` marker instead of raising, and the handler answers INVALID_ARGUMENT
"malformed request", counts it, and reports it through ``MalformedLog`` (one line per interval with a
count, never a traceback: a client sending garbage must not be able to flood the log).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: The status message of every malformed request.
MESSAGE = "malformed request"
#: At most one log line per this many seconds (per server).
LOG_EVERY_S = 10.0


class Malformed:
    """What a tolerant deserializer returns for bytes that are not the expected message."""

    __slots__ = ("error", "size")

    def __init__(self, error: Exception, size: int) -> None:
        self.error = error
        self.size = size


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


class MalformedLog:
    """Logs malformed requests at most once per ``every_s`` seconds, with how many arrived since."""

    def __init__(self, stage: str, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.stage = stage
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._count = 0
        self._last: float | None = None

    def record(self, method: str, malformed: Malformed) -> None:
        now = self._clock()
        with self._lock:
            self._count += 1
            if self._last is not None and now - self._last < self.every_s:
                return
            count, since = self._count, (None if self._last is None else now - self._last)
            self._count, self._last = 0, now
        window = "" if since is None else f" in the last {since:.0f}s"
        log.warning(
            "%s: %d malformed request(s)%s answered INVALID_ARGUMENT; latest: %s, %d bytes (%s: %s)",
            self.stage, count, window, method, malformed.size, type(malformed.error).__name__,
            str(malformed.error)[:200],
        )
