"""The gateway's admission control: a bound on Recommend calls in progress, and a refusal for a call
whose deadline is shorter than the time the calls already in progress will take.

That time comes from Little's law: with L calls in progress and the chain recently completing X calls
per second, a new call completes after about L / X seconds. Refusing it at once (RESOURCE_EXHAUSTED)
costs microseconds; admitting it would only make it, and the calls behind it, miss their deadlines
after using every stage. The rate is measured over the last second and only trusted from a handful
of completions, so an idle or just-started gateway admits up to ``max_in_flight``.
"""

from __future__ import annotations

import time
from collections import deque

from recpipe.errors import Overloaded

#: The window the completion rate is measured over, and the completions it needs to be trusted.
WINDOW_S = 1.0
MIN_COMPLETIONS = 10


class Admission:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self._completed: deque[float] = deque()

    def rate(self, now: float) -> float | None:
        """Completed calls per second over the last ``WINDOW_S`` (None while too few to trust)."""
        while self._completed and self._completed[0] < now - WINDOW_S:
            self._completed.popleft()
        return len(self._completed) / WINDOW_S if len(self._completed) >= MIN_COMPLETIONS else None

    def admit(self, deadline: float | None) -> None:
        """Count a call in, or raise ``Overloaded``; ``deadline`` is a ``time.monotonic()`` instant."""
        if self.in_flight >= self.max_in_flight:
            raise Overloaded(f"gateway: {self.in_flight} requests in flight (--max-in-flight {self.max_in_flight})")
        if deadline is not None and self.in_flight:
            now = time.monotonic()
            rate = self.rate(now)
            if rate is not None and deadline - now < self.in_flight / rate:
                raise Overloaded(f"gateway: {self.in_flight} requests in flight at {rate:.0f}/s need about "
                                 f"{self.in_flight / rate * 1e3:.0f} ms, more than the "
                                 f"{(deadline - now) * 1e3:.0f} ms left of the deadline")
        self.in_flight += 1

    def release(self, completed: bool) -> None:
        """Count a call out; ``completed`` calls (answered OK) feed the rate."""
        self.in_flight -= 1
        if completed:
            self._completed.append(time.monotonic())
