"""Latency histograms at microsecond resolution (HdrHistogram, 3 significant digits).

Three significant digits keep every recorded value within 0.1% from 1 us to an hour, where locust-style
two-digit buckets would round a 1,049 ms tail to 1,000 ms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 3_600_000_000  # one hour: anything longer is clamped, never dropped
SIGNIFICANT_DIGITS = 3

#: percentile -> JSON key, the summary every latency block carries
PERCENTILES: tuple[tuple[float, str], ...] = (
    (50.0, "p50_us"),
    (90.0, "p90_us"),
    (95.0, "p95_us"),
    (99.0, "p99_us"),
    (99.9, "p999_us"),
)

#: percentiles stored for CDF plots (dense in the tail, where the interesting part is)
CDF_PERCENTILES: tuple[float, ...] = (
    *[float(p) for p in range(0, 90, 5)],
    *[90.0 + i for i in range(10)],
    99.5, 99.9, 99.95, 99.99, 100.0,
)


class LatencyHistogram:
    """Records durations in microseconds; summarises them as p50..p99.9, max and mean."""

    def __init__(self) -> None:
        self._h = HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)
        # The exact sum, for the mean: hdrh's own mean walks every bucket in Python (~1 s each time).
        self._sum = 0

    def record_us(self, us: float) -> None:
        v = min(max(round(us), LOWEST_US), HIGHEST_US)
        self._h.record_value(v)
        self._sum += v

    def record_many_us(self, values: Sequence[float] | np.ndarray) -> None:
        """Record many durations at once: one HdrHistogram call per distinct microsecond value."""
        arr = np.clip(np.rint(np.asarray(values, dtype=np.float64)), LOWEST_US, HIGHEST_US).astype(np.int64)
        self._sum += int(arr.sum())
        uniq, counts = np.unique(arr, return_counts=True)
        for v, c in zip(uniq.tolist(), counts.tolist(), strict=True):
            self._h.record_value(v, c)

    @property
    def count(self) -> int:
        return int(self._h.get_total_count())

    def percentile_us(self, p: float) -> int:
        return int(self._h.get_value_at_percentile(p)) if self.count else 0

    def add(self, other: LatencyHistogram) -> None:
        self._h.add(other._h)
        self._sum += other._sum

    def __eq__(self, other: object) -> bool:
        """Same count in every bucket and the same exact sum (what a lossless merge must preserve)."""
        if not isinstance(other, LatencyHistogram):
            return NotImplemented
        return self._sum == other._sum and bool(self._h.equals(other._h))

    __hash__ = None  # type: ignore[assignment]  # mutable

    def to_wire(self) -> dict[str, Any]:
        """Plain data for another process: HdrHistogram's own compressed encoding (every bucket's
        count, lossless) and the exact sum. ``from_wire`` restores an equal histogram."""
        return {"hdr": self._h.encode().decode("ascii"), "sum": self._sum}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> LatencyHistogram:
        out = cls()
        out._h.add(HdrHistogram.decode(wire["hdr"].encode("ascii")))
        out._sum = int(wire["sum"])
        return out

    def summary(self) -> dict[str, float | int]:
        """``{count, p50_us, p90_us, p95_us, p99_us, p999_us, max_us, min_us, mean_us}`` (zeros when empty)."""
        out: dict[str, float | int] = {"count": self.count}
        for p, key in PERCENTILES:
            out[key] = self.percentile_us(p)
        out["max_us"] = int(self._h.get_max_value()) if self.count else 0
        out["min_us"] = int(self._h.get_min_value()) if self.count else 0
        out["mean_us"] = round(self._sum / self.count, 1) if self.count else 0.0
        return out

    def cdf(self) -> list[list[float]]:
        """``[[percentile, value_us], ...]`` at ``CDF_PERCENTILES`` (empty when nothing was recorded)."""
        if not self.count:
            return []
        return [[p, self.percentile_us(p)] for p in CDF_PERCENTILES]
