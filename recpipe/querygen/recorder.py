"""Per-query outcomes in, latency summaries out.

The hot path only appends floats to lists (tens of nanoseconds); histograms are filled once, after the
run, so recording never steals time from sending. Every query carries three instants (perf_counter
seconds): when it was *scheduled*, when it was actually *sent*, and when its answer came back.
End-to-end latency is ``done - scheduled``: a generator that falls behind still charges the delay to the
query, as a real user arriving at the scheduled instant would have seen it (no coordinated omission).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from recpipe.config import STAGES, TOTAL_STAGE
from recpipe.querygen.histogram import LatencyHistogram

#: (stage, server_us, observed_us) as carried by StageTiming
Timing = tuple[str, int, int]


@dataclass
class Recorder:
    """Collects outcomes of queries scheduled at or after ``measure_from`` (earlier ones are warm-up)."""

    measure_from: float
    e2e_us: list[float] = field(default_factory=list)
    lag_us: list[float] = field(default_factory=list)
    server_us: dict[str, list[float]] = field(default_factory=dict)
    observed_us: dict[str, list[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    warmup_queries: int = 0
    first_scheduled: float | None = None
    last_done: float | None = None
    sent: int = 0

    def _measured(self, scheduled: float, sent: float, done: float) -> bool:
        if scheduled < self.measure_from:
            self.warmup_queries += 1
            return False
        self.sent += 1
        self.lag_us.append((sent - scheduled) * 1e6)
        if self.first_scheduled is None or scheduled < self.first_scheduled:
            self.first_scheduled = scheduled
        if self.last_done is None or done > self.last_done:
            self.last_done = done
        return True

    def ok(self, scheduled: float, sent: float, done: float, timings: Iterable[Timing]) -> None:
        if not self._measured(scheduled, sent, done):
            return
        self.e2e_us.append((done - scheduled) * 1e6)
        for stage, server, observed in timings:
            self.server_us.setdefault(stage, []).append(server)
            self.observed_us.setdefault(stage, []).append(observed)

    def error(self, scheduled: float, sent: float, done: float, code: str) -> None:
        if self._measured(scheduled, sent, done):
            self.errors[code] += 1

    def running_p99_us(self) -> float:
        """p99 of the end-to-end latencies so far (for the progress line; exact, from the raw samples)."""
        return float(np.percentile(self.e2e_us, 99)) if self.e2e_us else 0.0

    def finish(self) -> Measurement:
        def hist(values: list[float]) -> LatencyHistogram:
            h = LatencyHistogram()
            if values:
                h.record_many_us(values)
            return h

        stages = {s: StageHistograms(hist(self.observed_us.get(s, [])), hist(self.server_us.get(s, [])))
                  for s in (*STAGES, TOTAL_STAGE)}
        return Measurement(
            end_to_end=hist(self.e2e_us),
            send_lag=hist([max(v, 0.0) for v in self.lag_us]),
            stages=stages,
            ok=len(self.e2e_us),
            errors=dict(self.errors),
            warmup_queries=self.warmup_queries,
            first_scheduled=self.first_scheduled,
            last_done=self.last_done,
        )


@dataclass
class StageHistograms:
    """One stage: the time its caller observed (network and (de)serialisation included) and server time."""

    observed: LatencyHistogram
    server: LatencyHistogram


@dataclass
class Measurement:
    end_to_end: LatencyHistogram
    send_lag: LatencyHistogram
    stages: dict[str, StageHistograms]
    ok: int
    errors: dict[str, int]
    warmup_queries: int
    first_scheduled: float | None
    last_done: float | None

    @property
    def queries(self) -> int:
        return self.ok + sum(self.errors.values())

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())
