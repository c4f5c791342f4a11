"""Percentiles of raw samples, the one summary the benches and the demo's tables print.

Exact (numpy's linear interpolation over every sample), for the few hundred to few thousand samples
a bench keeps; ``recpipe querygen`` records into an HdrHistogram instead (``querygen/histogram.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def percentiles(samples: Sequence[float] | np.ndarray, qs: Sequence[float], scale: float = 1.0) -> tuple[float, ...]:
    """The ``qs`` percentiles of ``samples`` divided by ``scale`` (1e3: ns -> µs); NaN each when empty."""
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        return tuple(float("nan") for _ in qs)
    return tuple(float(v) / scale for v in np.percentile(a, list(qs)))


def percentile(samples: Sequence[float] | np.ndarray, q: float, scale: float = 1.0) -> float:
    return percentiles(samples, (q,), scale)[0]


@dataclass(frozen=True)
class Summary:
    """Percentiles and mean of one series of samples, in the samples' unit."""

    count: int
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, samples: Sequence[float] | np.ndarray) -> Summary:
        a = np.asarray(samples, dtype=np.float64)
        p50, p90, p99 = percentiles(a, (50, 90, 99))
        return cls(int(a.size), p50, p90, p99, float(a.mean()) if a.size else float("nan"))
