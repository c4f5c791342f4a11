"""Offline quality metrics: AUC and recall@k."""

from __future__ import annotations

import numpy as np

from recpipe.auc import auc

__all__ = ["auc", "recall_at_k"]


def recall_at_k(retrieved: np.ndarray, user_rows: np.ndarray, item_ids: np.ndarray) -> float:
    """Share of (user, item) pairs whose item is in that user's retrieved row.

    retrieved: (U, k) item ids per evaluated user; user_rows: (P,) row of ``retrieved`` for each pair;
    item_ids: (P,) the held-out clicked item of each pair.
    """
    if item_ids.size == 0:
        return float("nan")
    hits = (retrieved[user_rows] == item_ids[:, None]).any(axis=1)
    return float(hits.mean())
