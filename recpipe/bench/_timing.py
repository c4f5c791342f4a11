"""Timing helpers shared by the per-stage benchmarks: warm-up, raw perf_counter_ns samples, percentiles."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from recpipe.percentiles import percentile
from recpipe.serving import nvtx


@dataclass(frozen=True)
class Timing:
    name: str
    samples_ns: np.ndarray
    rows_per_call: int = 1

    def pct_ms(self, q: float) -> float:
        return percentile(self.samples_ns, q, scale=1e6)

    @property
    def throughput(self) -> float:
        """rows per second at the mean call time."""
        return self.rows_per_call / (float(self.samples_ns.mean()) / 1e9)


def measure_interleaved(
    calls: Sequence[tuple[str, Callable[[int], object]]], n: int, warmup: int, rows_per_call: int = 1,
    block: int = 1, sleep_s: Sequence[float] = (),
) -> list[Timing]:
    """Time each ``call(i)`` for i in range(n), alternating between the calls so they share machine noise.

    ``block`` > 1 alternates blocks of that many calls instead of single calls, and runs one more,
    untimed, after each switch: a call that follows a different one pays for what that one evicted (a
    bf16 ranking forward took 2.1 ms after the fp32 DLRM forward and 0.85 ms after itself, on a 2-core
    EPYC), while a serving stage runs one form call after call.

    ``sleep_s``, one per call (missing ones 0): seconds asleep, untimed, before each timed call of that
    call, as a stage between sparse queries meets it."""
    for i in range(warmup):
        for _, fn in calls:
            fn(i)
    samples = np.zeros((len(calls), n), dtype=np.int64)
    block = max(1, block)
    pauses = [sleep_s[j] if j < len(sleep_s) else 0.0 for j in range(len(calls))]
    for first in range(0, n, block):
        for j, (_, fn) in enumerate(calls):
            if block > 1:
                fn(first)  # untimed: the switch from the call before
            for i in range(first, min(first + block, n)):
                if pauses[j]:
                    time.sleep(pauses[j])
                with nvtx.range(calls[j][0]):
                    t0 = time.perf_counter_ns()
                    fn(i)
                    samples[j, i] = time.perf_counter_ns() - t0
    return [Timing(name, samples[j], rows_per_call) for j, (name, _) in enumerate(calls)]


def table(timings: Sequence[Timing], baseline: str) -> str:
    """p50/p99 per form, throughput, and the p50 ratio of ``baseline`` over each."""
    base = next(t for t in timings if t.name == baseline)
    w = max(34, *(len(t.name) for t in timings))
    lines = [f"{'form':<{w}} {'p50 ms':>9} {'p99 ms':>9} {'rows/s':>12} {'speed-up p50':>13}"]
    for t in timings:
        lines.append(
            f"{t.name:<{w}} {t.pct_ms(50):>9.3f} {t.pct_ms(99):>9.3f} {t.throughput:>12,.0f} "
            f"{base.pct_ms(50) / t.pct_ms(50):>12.1f}x"
        )
    return "\n".join(lines)
