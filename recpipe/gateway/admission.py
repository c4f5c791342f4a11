"""The gateway's admission control: the one door of the chain. A bound on Recommend calls in progress,
and an immediate refusal for a call whose deadline the calls already in progress leave no room for.

The time a new call will take comes from what the gateway measures over the last ``WINDOW_S``: the
completion rate X and the mean time W of the calls that completed. By Little's law the chain held
L = X W calls on average while they took W each; with ``in_flight`` calls now, a new one takes about

    W (in_flight + 1) / (X W + 1)

which is the recent service time at low load (a call hardly waits) and (in_flight + 1) / X, the time
to drain the calls ahead at the measured throughput, under overload. That is a mean; a call admitted
with just the mean left misses its deadline about half the time, after using every stage. So a call is
admitted only with ``HEADROOM`` times it left, and refused at once (RESOURCE_EXHAUSTED, in
microseconds) otherwise: under overload the chain keeps working at capacity on calls that will make
their deadlines, and refuses the rest at the door instead of after a hop or three.

The figures are trusted from ``MIN_COMPLETIONS`` completions in the window, and the last trusted ones
are kept when completions stop (overload, a stalled stage): falling back to "admit everything" then
would let in a backlog that keeps completions at zero. Only a gateway that never measured admits up to
``max_in_flight`` on the bound alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from recpipe.errors import Overloaded

#: The window the completions are measured over, and how many it needs to be trusted.
WINDOW_S = 1.0
MIN_COMPLETIONS = 10
#: A call is admitted when its deadline covers this many times the time it is expected to take.
HEADROOM = 2.0


class Admission:
    def __init__(self, max_in_flight: int, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the ``time.monotonic`` the deadlines are instants of (a test passes its own)."""
        self.max_in_flight = max_in_flight
        self._clock = clock
        self.in_flight = 0
        self._completed: deque[tuple[float, float]] = deque()  # (when, how long it took), oldest first
        self._took_s = 0.0  # the sum of the window's durations
        self._measured: tuple[float, float] | None = None  # the last trusted (rate, mean duration)

    def measured(self, now: float) -> tuple[float, float] | None:
        """(completions per second, their mean duration in s) over the last ``WINDOW_S``; while too few
        completed in it to trust, the last trusted figures (None before the first)."""
        while self._completed and self._completed[0][0] < now - WINDOW_S:
            self._took_s -= self._completed.popleft()[1]
        n = len(self._completed)
        if n >= MIN_COMPLETIONS:
            self._measured = (n / WINDOW_S, max(self._took_s, 0.0) / n)
        return self._measured

    def expected_s(self, now: float) -> float | None:
        """How long a call admitted now is expected to take (see the module docstring)."""
        measured = self.measured(now)
        if measured is None:
            return None
        rate, took = measured
        return took * (self.in_flight + 1) / (rate * took + 1)

    def admit(self, deadline: float | None) -> float:
        """Count a call in and return its start instant, or raise ``Overloaded``; ``deadline`` is a
        ``time.monotonic()`` instant."""
        if self.in_flight >= self.max_in_flight:
            raise Overloaded(f"gateway: {self.in_flight} requests in flight (--max-in-flight {self.max_in_flight})")
        now = self._clock()
        if deadline is not None and self.in_flight:
            expected = self.expected_s(now)
            if expected is not None and deadline - now < HEADROOM * expected:
                raise Overloaded(f"gateway: with {self.in_flight} requests in flight a new one takes about "
                                 f"{expected * 1e3:.0f} ms; {(deadline - now) * 1e3:.0f} ms left of its deadline "
                                 f"is less than {HEADROOM:g}x that")
        self.in_flight += 1
        return now

    def release(self, started: float, completed: bool) -> None:
        """Count a call out (``started``: what ``admit`` returned); ``completed`` calls (answered OK)
        feed the measurements."""
        self.in_flight -= 1
        if completed:
            now = self._clock()
            self._completed.append((now, now - started))
            self._took_s += now - started
