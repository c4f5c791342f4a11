"""The expected ways an RPC ends without an answer, logged as counts: at most one line per kind per interval.

A malformed request body, a call refused under load (RESOURCE_EXHAUSTED), a deadline the call could not
make, a deadline that passed before the answer could be sent and a call its caller cancelled are not
faults of the server. Each is counted in ``recpipe_errors_total`` under its code (``ServerMetrics``) and
reported here: the first of a kind at once, the ones after it together, with their count, once the
interval is over; never a traceback, so a client that sends garbage, or deadlines no stage can meet,
cannot flood the log.

The interval's line is written by a timer on the server's event loop (or, outside a running loop, at the
kind's next record), and ``flush`` writes what is pending when the server stops, so every count reaches
the log.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: At most one line per kind per this many seconds (per server).
LOG_EVERY_S = 10.0


class Outcome(enum.Enum):
    """A kind of expected outcome: the status code it is counted under, and how its log line reads
    ("{stage}: {n} {noun}[ in the last Ns] {verb}; latest: {method}: {detail}")."""

    MALFORMED = ("INVALID_ARGUMENT", "malformed request(s)", "answered INVALID_ARGUMENT")
    REFUSED = ("RESOURCE_EXHAUSTED", "request(s) refused", "with RESOURCE_EXHAUSTED")
    DEADLINE = ("DEADLINE_EXCEEDED", "request(s) out of time", "answered DEADLINE_EXCEEDED")
    EXPIRED = ("DEADLINE_EXCEEDED", "request(s) past their deadline", "ended unanswered (the caller had timed out)")
    CANCELLED = ("CANCELLED", "request(s) cancelled", "by the caller, ended unanswered")

    def __init__(self, code: str, noun: str, verb: str) -> None:
        self.code = code
        self.noun = noun
        self.verb = verb


@dataclass
class _Tally:
    count: int = 0
    logged_at: float | None = None
    latest: tuple[str, str] = ("", "")
    timer: asyncio.TimerHandle | None = None


class OutcomeLog:
    """Logs each ``Outcome`` at most once per ``every_s`` seconds, with how many occurred since."""

    def __init__(self, stage: str, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.stage = stage
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tallies = {outcome: _Tally() for outcome in Outcome}

    def record(self, outcome: Outcome, method: str, detail: str) -> None:
        """One ``outcome`` of ``method``; ``detail`` says what happened (the status message, say)."""
        now = self._clock()
        with self._lock:
            t = self._tallies[outcome]
            t.count += 1
            t.latest = (method, detail)
            if t.logged_at is not None and now - t.logged_at < self.every_s:
                if t.timer is None:
                    t.timer = _call_later(self.every_s - (now - t.logged_at), self._due, outcome)
                return
            line = self._take(outcome, now)
        log.warning(*line)

    def flush(self) -> None:
        """Log every pending count now (the server is stopping)."""
        now = self._clock()
        with self._lock:
            lines = [self._take(outcome, now) for outcome, t in self._tallies.items() if t.count]
        for line in lines:
            log.warning(*line)

    def _due(self, outcome: Outcome) -> None:
        with self._lock:
            t = self._tallies[outcome]
            t.timer = None
            if not t.count:
                return
            line = self._take(outcome, self._clock())
        log.warning(*line)

    def _take(self, outcome: Outcome, now: float) -> tuple[object, ...]:
        """The log line (format and arguments) for ``outcome``'s pending count, which it resets."""
        t = self._tallies[outcome]
        if t.timer is not None:
            t.timer.cancel()
            t.timer = None
        since = None if t.logged_at is None else now - t.logged_at
        window = "" if since is None else f" in the last {since:.0f}s" if since >= 1 else f" in the last {since:.2f}s"
        count, (method, detail) = t.count, t.latest
        t.count, t.logged_at = 0, now
        return ("%s: %d %s%s %s; latest: %s: %s", self.stage, count, outcome.noun, window, outcome.verb, method,
                detail[:300])


def _call_later(delay_s: float, fn: Callable[[Outcome], None], outcome: Outcome) -> asyncio.TimerHandle | None:
    """``fn(outcome)`` in ``delay_s`` on the running event loop (None outside one: the next record logs)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.call_later(delay_s, fn, outcome)
