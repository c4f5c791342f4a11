"""How well the true click model itself does on the held-out interactions (the best achievable).

``auc``: AUC of the true click probability on the held-out rows. ``recall_at_k``: for a seeded sample
of held-out users, the share of their held-out clicked items found in their true top-k items, where
a user's true item score is ``log p(exposure of item | user) + log p(click | user, item)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recpipe.datagen.click_model import log_sigmoid
from recpipe.datagen.sampling import take_rows
from recpipe.datagen.world import S_ORACLE, World, rng_for


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (ties get average ranks); None when only one class is present."""
    y = np.asarray(labels).astype(bool)
    n = y.shape[0]
    n_pos = int(y.sum())
    n_neg = n - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(scores, kind="stable")
    s = np.asarray(scores)[order]
    distinct = np.empty(n, bool)
    distinct[0] = True
    np.not_equal(s[1:], s[:-1], out=distinct[1:])
    starts = np.flatnonzero(distinct)
    ends = np.append(starts[1:], n)
    avg_rank = (starts + ends + 1) / 2.0  # mean of the 1-based ranks starts+1..ends
    ranks = avg_rank[np.cumsum(distinct) - 1]
    rank_sum = float(ranks[y[order]].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + l) for each (s, l)."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts.astype(np.int64) - offsets, lengths) + np.arange(total, dtype=np.int64)


@dataclass
class RecallResult:
    recall: float | None
    users: int  # held-out users with clicks that were evaluated
    clicks: int  # their held-out clicks


class _TrueScorer:
    """Exact top-k of the true item scores of one user, scoring only items that can make the top k.

    Scores are ``lpc[cat] + log(w / W_cat) + log_sigmoid(click logit)`` and the last term is <= 0, so
    an item whose exposure part is below the k-th best score found so far can be skipped. Items are
    kept sorted by category, then by popularity descending, so the items of category ``c`` above a
    threshold are a prefix of its range, found by one ``searchsorted`` for all categories at once.
    """

    _OFF = 1.0e3  # > any -log(w / W_cat) here, so cat * _OFF + that is sorted

    def __init__(self, world: World) -> None:
        self.w = world
        it = world.items
        self.perm = np.lexsort((-it.w, it.cat)).astype(np.int64)
        self.cat_sorted = it.cat[self.perm]
        self.start = it.cat_start
        self.size = np.diff(it.cat_start)
        self.log_rel = np.log(it.w[self.perm] / it.cat_weight[self.cat_sorted])
        # item vectors in the same order: candidates are runs of consecutive positions, so gathering
        # them reads memory sequentially instead of one cache miss per item
        self.v = take_rows(it.v, self.perm)
        self.q = it.q[self.perm]
        self.search_key = self.cat_sorted * self._OFF - self.log_rel
        self.n_cat = world.params.n_cat
        self.cats = np.arange(self.n_cat)

    def log_p_cat(self, user: int) -> np.ndarray:
        w = self.w
        m = w.model.pref_mix
        p = (1.0 - m) * w.p_cat[w.users.fine[user]]
        p[w.users.pref[user]] += m
        with np.errstate(divide="ignore"):
            return np.log(p)

    def scores(self, user: int, lpc: np.ndarray, pos: np.ndarray) -> np.ndarray:
        w = self.w
        cat = self.cat_sorted[pos]
        dot = take_rows(self.v, pos) @ w.users.u[user]
        logit = w.model.logit(dot, self.q[pos], cat == w.users.pref[user])
        return lpc[cat] + self.log_rel[pos] + log_sigmoid(logit)

    def top_k(self, user: int, k: int, first_cats: int = 32, first_items: int = 400) -> np.ndarray:
        lpc = self.log_p_cat(user)
        # a first guess at the k-th best score from the head items of the user's likeliest categories
        top = np.argpartition(-lpc, min(first_cats, self.n_cat - 1))[:first_cats]
        pos = _ranges(self.start[top], np.minimum(self.size[top], first_items))
        s = self.scores(user, lpc, pos)
        kth = np.partition(s, s.shape[0] - k)[s.shape[0] - k] if s.shape[0] >= k else -np.inf
        if np.isfinite(kth):
            th = kth - lpc  # items of category c with log_rel >= th can beat kth
            ok = np.isfinite(th)
            keys = self.cats * self._OFF - np.where(ok, th, 0.0)
            count = np.searchsorted(self.search_key, keys, side="right") - self.start[:-1]
            count = np.where(ok, np.clip(count, 0, self.size), 0)
            pos = _ranges(self.start[:-1], count)
        else:
            pos = np.arange(self.perm.shape[0])
        s = self.scores(user, lpc, pos)
        if s.shape[0] > k:
            pos = pos[np.argpartition(-s, k - 1)[:k]]
        return self.perm[pos]


def recall_at_k(world: World, user: np.ndarray, item: np.ndarray, label: np.ndarray, k: int = 500,
                max_users: int = 1000) -> RecallResult:
    clicked = label.astype(bool)
    cu, ci = user[clicked], item[clicked]
    if cu.shape[0] == 0:
        return RecallResult(None, 0, 0)
    order = np.argsort(cu, kind="stable")
    cu, ci = cu[order], ci[order]
    uniq = np.unique(cu)
    rng = rng_for(world.cfg.seed, S_ORACLE)
    sample = np.sort(rng.choice(uniq, size=min(max_users, uniq.shape[0]), replace=False))
    lo = np.searchsorted(cu, sample, side="left")
    hi = np.searchsorted(cu, sample, side="right")
    clicks = int((hi - lo).sum())
    if world.items.n <= k:
        return RecallResult(1.0, int(sample.shape[0]), clicks)
    scorer = _TrueScorer(world)
    hits = 0
    for u, a, b in zip(sample.tolist(), lo.tolist(), hi.tolist(), strict=True):
        top = scorer.top_k(u, k)
        hits += int(np.isin(ci[a:b], top).sum())
    return RecallResult(hits / clicks, int(sample.shape[0]), clicks)
