"""The time split of the interactions: the latest ``HOLDOUT_FRACTION`` of them (by timestamp) are held out.

Shared vocabulary: training fits on the rest, and the feature stage computes its history counts from it.

The interactions file is sorted by timestamp, so the split is by position — the same rows the
generator's oracle is evaluated on.
"""

from __future__ import annotations

import polars as pl

from recpipe.schema import HOLDOUT_FRACTION


def holdout_size(n: int, fraction: float = HOLDOUT_FRACTION) -> int:
    return min(n, round(n * fraction))


def split_by_time(interactions: pl.DataFrame, fraction: float = HOLDOUT_FRACTION) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(train, holdout): rows in timestamp order, the last ``fraction`` of them held out."""
    frame = interactions
    ts = frame["timestamp"]
    if frame.height > 1 and not bool((ts.diff().drop_nulls() >= 0).all()):
        frame = frame.sort("timestamp", maintain_order=True)
    n_hold = holdout_size(frame.height, fraction)
    return frame.head(frame.height - n_hold), frame.tail(n_hold)
