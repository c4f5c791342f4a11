"""Offline quality metrics: AUC and recall@k."""

from __future__ import annotations

import numpy as np
import polars as pl


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the rank-sum formula (ties share the average rank); NaN if one class is missing."""
    y = np.asarray(labels).astype(bool)
    n_pos = int(y.sum())
    n_neg = int(y.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = pl.Series(np.asarray(scores, dtype=np.float64)).rank("average").to_numpy()
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def recall_at_k(retrieved: np.ndarray, user_rows: np.ndarray, item_ids: np.ndarray) -> float:
    """Share of (user, item) pairs whose item is in that user's retrieved row.

    retrieved: (U, k) item ids per evaluated user; user_rows: (P,) row of ``retrieved`` for each pair;
    item_ids: (P,) the held-out clicked item of each pair.
    """
    if item_ids.size == 0:
        return float("nan")
    hits = (retrieved[user_rows] == item_ids[:, None]).any(axis=1)
    return float(hits.mean())
