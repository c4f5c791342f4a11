"""Per-query outcomes in, latency summaries out.

The hot path only appends to lists (tens of nanoseconds): each answer's latency and its stages' timings.
The histograms, and each answered query's split by stage (``recpipe.querygen.attribution``), are made
once, after the run, so recording never steals time from sending. Every query carries three instants
(perf_counter seconds): when it was *scheduled*, when it was actually *sent*, and when its answer came back.
End-to-end latency is ``done - scheduled``: a generator that falls behind still charges the delay to the
query, as a real user arriving at the scheduled instant would have seen it (no coordinated omission).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recpipe.config import STEPS, TOTAL_STEP
from recpipe.querygen.attribution import TailSplit, split_row
from recpipe.querygen.histogram import LatencyHistogram

#: a query sent later than this after its scheduled instant counts as sent late (perf_analyzer reports
#: the same share for its own request schedule)
LATE_US = 1000.0

#: (stage, server_us, observed_us[, queue_us, compute_us, batch_size]) as carried by StageTiming; the
#: last three are the stage batcher's split of server_us (perf_analyzer's queue/compute) and count only
#: when batch_size > 0, i.e. when the stage reports them (older stages send zeros)
Timing = tuple[int | str, ...]


@dataclass
class Recorder:
    """Collects outcomes of queries scheduled at or after ``measure_from`` (earlier ones are warm-up)."""

    measure_from: float
    e2e_us: list[float] = field(default_factory=list)
    #: each answered query's stage timings, in the order of ``e2e_us``: the stages' histograms and the
    #: query's split into parts (``recpipe.querygen.attribution.split_row``) are made from them after the run
    answered: list[list[Timing]] = field(default_factory=list)
    #: each answered query's send lag, in the order of ``e2e_us`` (its part of the client's time)
    answered_lag_us: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    #: each failed query's time from its scheduled send to its failure (a deadline's queries fail no
    #: sooner than the deadline: left out of every latency, they would hide the very tail they are),
    #: and its send lag (``finish`` counts it at least until its deadline)
    failed_us: list[float] = field(default_factory=list)
    failed_lag_us: list[float] = field(default_factory=list)
    warmup_queries: int = 0
    first_scheduled: float | None = None
    last_done: float | None = None
    sent: int = 0

    def _measured(self, scheduled: float, sent: float, done: float) -> bool:
        if scheduled < self.measure_from:
            self.warmup_queries += 1
            return False
        self.sent += 1
        if self.first_scheduled is None or scheduled < self.first_scheduled:
            self.first_scheduled = scheduled
        if self.last_done is None or done > self.last_done:
            self.last_done = done
        return True

    def ok(self, scheduled: float, sent: float, done: float, timings: Iterable[Timing]) -> None:
        if not self._measured(scheduled, sent, done):
            return
        self.e2e_us.append((done - scheduled) * 1e6)
        self.answered_lag_us.append((sent - scheduled) * 1e6)
        self.answered.append(timings if isinstance(timings, list) else list(timings))

    def error(self, scheduled: float, sent: float, done: float, code: str) -> None:
        if self._measured(scheduled, sent, done):
            self.errors[code] += 1
            self.failed_us.append((done - scheduled) * 1e6)
            self.failed_lag_us.append((sent - scheduled) * 1e6)

    def running_p99_us(self) -> float:
        """p99 of the end-to-end latencies so far (for the progress line; exact, from the raw samples)."""
        return float(np.percentile(self.e2e_us, 99)) if self.e2e_us else 0.0

    def finish(self, deadline_s: float | None = None) -> Measurement:
        """The run's histograms. ``deadline_s``: each query's deadline after its send; a query that failed
        sooner (shed, unavailable) counts as unanswered until then, never as a fast answer."""
        lags = [*self.answered_lag_us, *self.failed_lag_us]  # every measured query's send lag

        def hist(values: list[float]) -> LatencyHistogram:
            h = LatencyHistogram()
            if values:
                h.record_many_us(values)
            return h

        server: dict[str, list[float]] = {}
        observed: dict[str, list[float]] = {}
        queue: dict[str, list[float]] = {}
        compute: dict[str, list[float]] = {}
        batches: dict[str, list[int]] = {}
        splits = []
        for e2e, lag, timings in zip(self.e2e_us, self.answered_lag_us, self.answered, strict=True):
            parts = {}
            for t in timings:
                stage, batch = str(t[0]), int(t[5]) if len(t) >= 6 else 0
                server.setdefault(stage, []).append(float(t[1]))
                observed.setdefault(stage, []).append(float(t[2]))
                if batch > 0:  # the stage reported its batcher's split
                    queue.setdefault(stage, []).append(float(t[3]))
                    compute.setdefault(stage, []).append(float(t[4]))
                    batches.setdefault(stage, []).append(batch)
                parts[stage] = (float(t[1]), float(t[2]), batch)
            splits.append(split_row(e2e, parts, lag))
        stages = {s: StageHistograms(hist(observed.get(s, [])), hist(server.get(s, [])), hist(queue.get(s, [])),
                                     hist(compute.get(s, [])), batches.get(s, []))
                  for s in (*STEPS, TOTAL_STEP)}
        return Measurement(
            end_to_end=hist(self.e2e_us),
            send_lag=hist([max(v, 0.0) for v in lags]),
            stages=stages,
            ok=len(self.e2e_us),
            errors=dict(self.errors),
            warmup_queries=self.warmup_queries,
            first_scheduled=self.first_scheduled,
            last_done=self.last_done,
            late_sends=sum(1 for v in lags if v > LATE_US),
            measure_from=self.measure_from,
            split=TailSplit.of(splits),
            failed=hist(self.failed_us if deadline_s is None else
                        [max(t, lag + deadline_s * 1e6) for t, lag in zip(self.failed_us, self.failed_lag_us, strict=True)]),
        )


@dataclass
class StageHistograms:
    """One stage: the time its caller observed (network and (de)serialisation included), server time,
    and, where the stage reports them, its queue and compute time and the batch sizes it ran in."""

    observed: LatencyHistogram
    server: LatencyHistogram
    queue: LatencyHistogram = field(default_factory=LatencyHistogram)
    compute: LatencyHistogram = field(default_factory=LatencyHistogram)
    batch_sizes: list[int] = field(default_factory=list)

    def add(self, other: StageHistograms) -> None:
        self.observed.add(other.observed)
        self.server.add(other.server)
        self.queue.add(other.queue)
        self.compute.add(other.compute)
        self.batch_sizes.extend(other.batch_sizes)

    def to_wire(self) -> dict[str, Any]:
        """Plain data (see ``LatencyHistogram.to_wire``); batch sizes as {size: how many}."""
        return {"observed": self.observed.to_wire(), "server": self.server.to_wire(),
                "queue": self.queue.to_wire(), "compute": self.compute.to_wire(),
                "batch_sizes": dict(Counter(self.batch_sizes))}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> StageHistograms:
        sizes = [int(size) for size, n in wire["batch_sizes"].items() for _ in range(int(n))]
        return cls(LatencyHistogram.from_wire(wire["observed"]), LatencyHistogram.from_wire(wire["server"]),
                   LatencyHistogram.from_wire(wire["queue"]), LatencyHistogram.from_wire(wire["compute"]), sizes)

    def batch_summary(self) -> dict[str, float | int]:
        """``{count, mean, max}`` of the batch sizes (count 0: the stage reported none)."""
        b = self.batch_sizes
        return {"count": len(b), "mean": round(sum(b) / len(b), 2) if b else 0.0, "max": max(b) if b else 0}


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
    late_sends: int = 0
    #: the instant (perf_counter s) measuring began: the end of the warm-up
    measure_from: float = 0.0
    #: the answered queries' end-to-end time split by stage (``recpipe.querygen.attribution``)
    split: TailSplit = field(default_factory=TailSplit)
    #: the failed queries' time from their scheduled send to their failure, or to their deadline if they
    #: failed sooner: an error is no answer, however fast (``end_to_end`` holds only the answered ones, as
    #: the stages' and the attribution's numbers do)
    failed: LatencyHistogram = field(default_factory=LatencyHistogram)

    def every_query(self) -> LatencyHistogram:
        """End to end of every measured query: the answered ones to their answer, the failed ones to their
        failure or their deadline, whichever is later (``failed``): a failed query counts no faster than its
        deadline. Where nothing failed this equals ``end_to_end``."""
        out = LatencyHistogram()
        out.add(self.end_to_end)
        out.add(self.failed)
        return out

    @property
    def queries(self) -> int:
        return self.ok + sum(self.errors.values())

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_wire(self) -> dict[str, Any]:
        """Everything, as plain data (dicts, numbers, strings) for a pipe between our own processes; the
        histograms in HdrHistogram's lossless encoding, so a merge of decoded parts is exact."""
        return {"end_to_end": self.end_to_end.to_wire(), "send_lag": self.send_lag.to_wire(),
                "stages": {name: h.to_wire() for name, h in self.stages.items()}, "ok": self.ok,
                "errors": dict(self.errors), "warmup_queries": self.warmup_queries,
                "first_scheduled": self.first_scheduled, "last_done": self.last_done,
                "late_sends": self.late_sends, "measure_from": self.measure_from, "split": self.split.to_wire(),
                "failed": self.failed.to_wire()}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Measurement:
        return cls(end_to_end=LatencyHistogram.from_wire(wire["end_to_end"]),
                   send_lag=LatencyHistogram.from_wire(wire["send_lag"]),
                   stages={name: StageHistograms.from_wire(h) for name, h in wire["stages"].items()},
                   ok=int(wire["ok"]), errors={str(k): int(v) for k, v in wire["errors"].items()},
                   warmup_queries=int(wire["warmup_queries"]), first_scheduled=wire["first_scheduled"],
                   last_done=wire["last_done"], late_sends=int(wire["late_sends"]),
                   measure_from=float(wire["measure_from"]), split=TailSplit.from_wire(wire.get("split", {})),
                   failed=LatencyHistogram.from_wire(wire["failed"]))


def merge(parts: list[Measurement]) -> Measurement:
    """One measurement holding every sample of ``parts`` (the agreeing windows of a stability run, or
    the sender processes of one run): histograms added bucket by bucket (exact), counts summed, and the
    time span from the earliest part's start to the latest part's last answer."""
    def earliest(values: Iterable[float | None]) -> float | None:
        return min((v for v in values if v is not None), default=None)

    def latest(values: Iterable[float | None]) -> float | None:
        return max((v for v in values if v is not None), default=None)

    out = Measurement(end_to_end=LatencyHistogram(), send_lag=LatencyHistogram(),
                      stages={s: StageHistograms(LatencyHistogram(), LatencyHistogram())
                              for m in parts for s in m.stages},
                      ok=0, errors={}, warmup_queries=0, first_scheduled=earliest(m.first_scheduled for m in parts),
                      last_done=latest(m.last_done for m in parts),
                      measure_from=min(m.measure_from for m in parts))
    for m in parts:
        out.end_to_end.add(m.end_to_end)
        out.send_lag.add(m.send_lag)
        for name, h in m.stages.items():
            out.stages[name].add(h)
        out.ok += m.ok
        for code, n in m.errors.items():
            out.errors[code] = out.errors.get(code, 0) + n
        out.warmup_queries += m.warmup_queries
        out.late_sends += m.late_sends
        out.split.add(m.split)
        out.failed.add(m.failed)
    return out
