"""ROC AUC by the rank-sum formula, in numpy: one definition for the generator's oracle, training's
held-out metrics and the ranking stage's precision check."""

from __future__ import annotations

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (ties share the average rank);
    NaN when only one class is present."""
    y = np.asarray(labels).astype(bool)
    n = y.shape[0]
    n_pos = int(y.sum())
    n_neg = n - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    s = np.asarray(scores, dtype=np.float64)[order]
    distinct = np.empty(n, bool)
    distinct[0] = True
    np.not_equal(s[1:], s[:-1], out=distinct[1:])
    starts = np.flatnonzero(distinct)
    ends = np.append(starts[1:], n)
    avg_rank = (starts + ends + 1) / 2.0  # mean of the 1-based ranks starts+1..ends
    ranks = avg_rank[np.cumsum(distinct) - 1]
    rank_sum = float(ranks[y[order]].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)
