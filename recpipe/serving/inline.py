"""Whether a core call may run inline on the event loop or must go to a thread: by its predicted time.

Inline saves the thread hop, about 250 µs per call under load (BENCHMARKS.md, "Serving under load"),
but holds the loop for the whole call: nothing else on it runs meanwhile, not even the health service.
A stage whose health does not answer for ``--unresponsive-timeout`` seconds is killed by its supervisor
as frozen, and the gateway treats it as down; so a call that may be long must not run inline.

``CallCost`` learns a core entry point's seconds per *row* (what its ``Method`` counts: candidates for
Rank, items for AugmentItems, 1 for the others), as an average over its recent calls wherever they ran,
and a call is *short* when its rows times that is at most ``INLINE_MAX_S`` and it is no larger than
calls already seen. Only a short call runs inline, and only where inline calls are allowed
(``--workers 0``). The first call, and a call larger than any before it, have no estimate and go to
the thread: first calls of a size are where allocations grow and compiled or captured forms are built.
A call that takes much longer than predicted is still held inline once; it raises the average, which
sends the calls after it to the thread until the average has come back down.

``CallCost`` also adds up the CPU time its calls spent (``cpu_s``): the CPU clock of the thread each
call ran on, inline or not, around the core call alone. A stage reports the sum over its entry points
in GetInfo (``COMPUTE_CPU_KEY``), so a measurement can set a stage's own computing against all the CPU
its process spent: the rest is serving it (gRPC, asyncio, decoding and encoding, batching, health).
Threads a library starts for itself (torch or FAISS with ``--threads`` above 1) are not in it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

A = TypeVar("A")
T = TypeVar("T")

#: The longest predicted call that runs inline: a thread hop is at most ~2.5% of a call this long,
#: and a health check waits at most about this long behind it.
INLINE_MAX_S = 0.010
#: Weight of the newest call in the average.
_EWMA = 0.2
#: GetInfo ``details`` key of a stage's core calls' CPU seconds so far, all entry points together
#: (``CallCost.cpu_s``), as a decimal string
COMPUTE_CPU_KEY = "compute_cpu_s"


class CallCost:
    """The recent seconds per row of one core entry point, and whether a call of ``rows`` is short."""

    def __init__(self) -> None:
        #: Recent seconds per row (an EWMA over calls); None before the first call.
        self.row_s: float | None = None
        #: The most rows one call has had so far.
        self.max_rows = 0
        #: CPU seconds the calls spent so far, on the threads they ran on
        self.cpu_s = 0.0
        self._lock = threading.Lock()  # calls may finish on the loop and on a thread at once

    def predict_s(self, rows: int) -> float | None:
        """The expected seconds of a call of ``rows``; None without an estimate for that size."""
        if self.row_s is None or rows > self.max_rows:
            return None
        return self.row_s * rows

    def short(self, rows: int) -> bool:
        """Whether a call of ``rows`` is predicted to take at most ``INLINE_MAX_S``."""
        predicted = self.predict_s(rows)
        return predicted is not None and predicted <= INLINE_MAX_S

    def call(self, fn: Callable[[A], T], arg: A, rows: int) -> T:
        """``fn(arg)``, a call of ``rows``, timed where it runs (so a thread hop is not counted: the
        estimate is of how long the call would hold the loop) and learnt, even when it raises; its
        thread's CPU time is added to ``cpu_s``."""
        cpu = time.thread_time_ns()
        start = time.perf_counter()
        try:
            return fn(arg)
        finally:
            self.learn(time.perf_counter() - start, rows, (time.thread_time_ns() - cpu) / 1e9)

    def learn(self, seconds: float, rows: int, cpu_s: float = 0.0) -> None:
        """Fold a call of ``rows`` that took ``seconds`` (and ``cpu_s`` of CPU) into the estimate."""
        per_row = seconds / max(rows, 1)
        with self._lock:
            self.row_s = per_row if self.row_s is None else (1 - _EWMA) * self.row_s + _EWMA * per_row
            self.max_rows = max(self.max_rows, rows)
            self.cpu_s += cpu_s


def start_thread(pool: ThreadPoolExecutor) -> None:
    """Start ``pool``'s first thread now rather than with the first call sent to it: a thread start on
    the request path made a fresh stage's first calls 1-3 ms slower."""
    pool.submit(int)
