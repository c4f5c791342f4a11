"""recpipe.percentiles: numpy's linear interpolation, scaling, and NaN for no samples."""

from __future__ import annotations

import math

import numpy as np

from recpipe.percentiles import Summary, percentile, percentiles


def test_percentiles_interpolate_and_scale() -> None:
    ns = [1000, 2000, 3000, 4000, 5000]
    assert percentiles(ns, (0, 50, 100)) == (1000.0, 3000.0, 5000.0)
    assert percentile(ns, 50, scale=1e3) == 3.0
    assert percentile(ns, 90) == 4600.0  # between the 4th and 5th sample, as np.percentile does
    assert percentile(np.arange(101), 99) == 99.0


def test_summary_of_samples_and_of_nothing() -> None:
    s = Summary.of([10.0, 20.0, 30.0])
    assert (s.count, s.p50, s.mean) == (3, 20.0, 20.0)
    assert s.p90 == 28.0 and s.p99 == 29.8
    empty = Summary.of([])
    assert empty.count == 0 and all(math.isnan(v) for v in (empty.p50, empty.p90, empty.p99, empty.mean))
    assert all(math.isnan(v) for v in percentiles([], (50, 99)))
