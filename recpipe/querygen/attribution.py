"""Where the slow queries' time went: each answered query's end-to-end latency split by stage, for the
median band and the slowest 1%.

Per-stage percentiles cannot say it: the stages' p99s come from different queries and may sum past the
end-to-end p99. So the parts of one query are kept together. A query's end-to-end time is

    client + gateway + sum over the stages of (server + hop)

- ``server``: inside the stage's own server;
- ``hop``: the stage's observed time minus its server time, i.e. waiting in the gateway's batched hop,
  the network, and (de)serialisation;
- ``gateway``: the gateway's own time between its hops (the whole Recommend handler less its stages'
  observed times);
- ``client``: the rest of the end-to-end time, i.e. this generator's send lag and the gateway's own
  gRPC receive and send (and the network to it). Of it, ``send_lag`` is the generator's part (sent
  after its scheduled instant): a stalled generator and a stalled gateway both lengthen ``client``, and
  only this tells them apart. It is inside ``client``, not beside it: the other parts sum to end to end.

The splits are summed per end-to-end latency bucket (``BUCKET_WIDTH`` wide, log-spaced), which merges
exactly across sender processes and stability windows. A band of percentiles is the mean split of the
queries whose end-to-end latency falls in it; a bucket that straddles the band's edge counts by the
share of its queries inside.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recpipe.config import STEPS, TOTAL_STEP

#: relative width of an end-to-end latency bucket: a band's edge falls within 2% of its exact place
BUCKET_WIDTH = 0.02
_LOG_WIDTH = math.log1p(BUCKET_WIDTH)
#: the parts of one query, in the order ``split_row`` writes them (after the end-to-end time)
PARTS: tuple[str, ...] = ("client", "gateway", *(f"{s}.{p}" for s in STEPS for p in ("server", "hop", "batch")),
                          "client.send_lag")
#: the bands a run document carries: (name, lowest percentile, highest percentile)
BANDS: tuple[tuple[str, float, float], ...] = (("median", 45.0, 55.0), ("p99", 99.0, 100.0))


def split_row(e2e_us: float, timings: Mapping[str, tuple[float, float, int]], lag_us: float = 0.0
              ) -> tuple[float, ...]:
    """(end to end, *PARTS) of one answered query; ``timings``: stage -> (server_us, observed_us,
    batch_size) as the gateway reported them (batch 0: not reported); ``lag_us``: how late the generator
    sent it. Without the gateway's total (a ``--per-component`` run calls the stages itself) the gateway
    part is 0 and the client part holds what the stages' observed times leave."""
    row = [e2e_us, 0.0, 0.0]
    observed = 0.0
    for stage in STEPS:
        server, seen, batch = timings.get(stage, (0.0, 0.0, 0))
        observed += seen
        row += [server, seen - server, float(batch)]
    total = timings.get(TOTAL_STEP)
    handler = total[0] if total is not None else observed
    row[1] = e2e_us - handler
    row[2] = handler - observed
    row.append(max(lag_us, 0.0))
    return tuple(row)


@dataclass
class TailSplit:
    """Per end-to-end bucket: [queries, sum of end-to-end us, sum of each of ``PARTS``]."""

    buckets: dict[int, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, rows: Sequence[tuple[float, ...]]) -> TailSplit:
        out = cls()
        if not rows:
            return out
        arr = np.asarray(rows, dtype=np.float64)
        index = np.floor(np.log(np.maximum(arr[:, 0], 1.0)) / _LOG_WIDTH).astype(np.int64)
        sums = np.column_stack([np.ones(len(arr)), arr])
        for b in np.unique(index).tolist():
            out.buckets[int(b)] = sums[index == b].sum(axis=0)
        return out

    def add(self, other: TailSplit) -> None:
        for b, s in other.buckets.items():
            mine = self.buckets.get(b)
            self.buckets[b] = s.copy() if mine is None else mine + s

    @property
    def queries(self) -> int:
        return int(sum(s[0] for s in self.buckets.values()))

    def band(self, lo: float, hi: float) -> dict[str, Any] | None:
        """The mean split of the queries between the ``lo``-th and ``hi``-th percentile of end-to-end
        latency (None without queries): ``queries`` (how many fall in the band, rounded), ``end_to_end_us``,
        ``client_us`` (of it ``send_lag_us``), ``gateway_us``, and per stage ``server_us``, ``hop_us`` and ``batch_size`` (the mean of
        the core-call batch sizes the stage reported; None where it reported none)."""
        n = self.queries
        if n == 0:
            return None
        first, last = n * lo / 100.0, n * hi / 100.0
        total = np.zeros(len(PARTS) + 2)
        below = 0.0
        for b in sorted(self.buckets):
            s = self.buckets[b]
            count = float(s[0])
            inside = max(0.0, min(below + count, last) - max(below, first))
            below += count
            if inside <= 0.0:
                continue
            share = inside / count
            total += s * share
        weight = float(total[0])
        if weight <= 0.0:
            return None
        mean = total / weight
        parts = dict(zip(PARTS, mean[2:].tolist(), strict=True))
        out: dict[str, Any] = {"percentiles": [lo, hi], "queries": round(weight),
                               "end_to_end_us": round(float(mean[1]), 1),
                               "client_us": round(parts["client"], 1),
                               "send_lag_us": round(parts["client.send_lag"], 1),
                               "gateway_us": round(parts["gateway"], 1), "stages": {}}
        for stage in STEPS:
            batch = parts[f"{stage}.batch"]
            out["stages"][stage] = {"server_us": round(parts[f"{stage}.server"], 1),
                                    "hop_us": round(parts[f"{stage}.hop"], 1),
                                    "batch_size": round(batch, 2) if batch > 0 else None}
        return out

    def bands(self) -> dict[str, dict[str, Any] | None]:
        """Every band of ``BANDS`` by name (what a run document's ``attribution`` holds)."""
        return {name: self.band(lo, hi) for name, lo, hi in BANDS}

    def to_wire(self) -> dict[str, list[float]]:
        return {str(b): s.tolist() for b, s in self.buckets.items()}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Iterable[float]]) -> TailSplit:
        return cls({int(b): np.asarray(list(s), dtype=np.float64) for b, s in wire.items()})
