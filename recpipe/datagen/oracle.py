"""How well the true click model itself does on the held-out interactions (the best achievable).

``auc``: AUC of the true click probability on the held-out rows. ``recall_at_k``: for a seeded sample
of held-out users, the share of their held-out clicked items found in their true top-k items, where
a user's true item score is ``log p(exposure of item | user) + log p(click | user, item)``
(the oracle ranks by the product of the two probabilities, which is the same order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recpipe.auc import auc as shared_auc
from recpipe.datagen.sampling import take_rows
from recpipe.datagen.world import S_ORACLE, World, rng_for


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (ties get average ranks); None when only one class is present."""
    value = shared_auc(labels, scores)
    return None if np.isnan(value) else value


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

    Ranking by ``p(exposure) * p(click)`` is ranking by the log score. ``p(click) <= 1``, so an item whose
    exposure probability ``p(cat | user) * w / W_cat`` is below the k-th best score found so far cannot
    make the top k. Items are kept sorted by category, then by popularity descending, so the items of
    category ``c`` above a threshold are a prefix of its range, whose length a table lookup bounds. Scores are float32: a tie at the boundary may resolve either way.
    """

    #: Per category, how many items have log(w / W_c) >= -j * _STEP, for j < _LEVELS: a lookup that
    #: rounds a threshold down to a level replaces a binary search (cache misses) per category.
    _STEP = 0.25
    _LEVELS = 160

    def __init__(self, world: World) -> None:
        self.w = world
        it = world.items
        self.perm = it.order
        self.cat_sorted = it.cat_pos
        self.start = it.cat_start
        self.size = np.diff(it.cat_start)
        rel = it.w[self.perm] / it.cat_weight[self.cat_sorted]
        self.rel = rel.astype(np.float32)
        # log(w / W_c) is descending within each category; level j of category c counts the prefix
        # with -log(w / W_c) <= j * _STEP
        level = np.minimum(np.ceil(-np.log(rel) / self._STEP), self._LEVELS).astype(np.int64)
        hist = np.zeros((world.params.n_cat, self._LEVELS + 1), np.int64)
        np.add.at(hist, (self.cat_sorted, level), 1)
        self.level_count = np.cumsum(hist, axis=1)
        self.level_count[:, -1] = self.size  # beyond the last level: every item of the category
        self.v = it.v_pos
        self.q = it.q_pos
        self.n_cat = world.params.n_cat
        self.cats = np.arange(self.n_cat)

    def p_cat(self, user: int) -> np.ndarray:
        """p(category | user), float64 (n_cat,)."""
        w = self.w
        m = w.model.pref_mix
        p = (1.0 - m) * w.p_cat[w.users.fine[user]]
        p[w.users.pref[user]] += m
        return p

    def scores(self, user: int, pc: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """p(exposure) * p(click) of the items at sorted positions ``pos`` (float32)."""
        w = self.w
        cat = self.cat_sorted[pos]
        dot = take_rows(self.v, pos) @ w.users.u[user]
        p_click = w.model.click_probability32(dot, self.q[pos], cat == w.users.pref[user])
        p_click *= self.rel[pos]
        p_click *= pc[cat]
        return p_click

    def top_k(self, user: int, k: int, first_cats: int = 16, first_items: int = 300) -> np.ndarray:
        pc64 = self.p_cat(user)
        pc = pc64.astype(np.float32)
        # a first guess at the k-th best score from the head items of the user's likeliest categories
        top = np.argpartition(-pc64, min(first_cats, self.n_cat - 1))[:first_cats]
        pos = _ranges(self.start[top], np.minimum(self.size[top], first_items))
        s = self.scores(user, pc, pos)
        kth = float(np.partition(s, s.shape[0] - k)[s.shape[0] - k]) if s.shape[0] >= k else 0.0
        if kth > 0.0:
            # items of category c with log(w / W_c) >= log(kth / p_c) can beat kth; rounding the
            # threshold down to a level (and a little slack for float32) only adds candidates
            ok = pc64 > 0
            with np.errstate(divide="ignore"):
                need = np.log(kth * (1.0 - 1e-5)) - np.log(np.where(ok, pc64, 1.0))
            level = np.clip(np.ceil(-need / self._STEP), 0, self._LEVELS).astype(np.int64)
            count = np.where(ok, self.level_count[self.cats, level], 0)
            pos = _ranges(self.start[:-1], count)
        else:
            pos = np.arange(self.perm.shape[0])
        s = self.scores(user, pc, pos)
        if s.shape[0] > k:
            pos = pos[np.argpartition(-s, k - 1)[:k]]
        return self.perm[pos]


class RecallOracle:
    """recall@k of the true scores, split into chunks of users that can run on separate threads.

    ``RecallOracle(...)`` samples the users; ``prepare()`` builds the scorer; ``hits(chunk)`` scores one
    chunk of users; ``result(sum of hits)`` is the recall.
    """

    def __init__(self, world: World, user: np.ndarray, item: np.ndarray, label: np.ndarray, k: int,
                 max_users: int) -> None:
        self.world = world
        self.k = k
        clicked = label.astype(bool)
        cu, ci = user[clicked], item[clicked]
        order = np.argsort(cu, kind="stable")
        self._clicked_items = ci[order]
        cu = cu[order]
        uniq = np.unique(cu)
        rng = rng_for(world.cfg.seed, S_ORACLE)
        self.users = np.sort(rng.choice(uniq, size=min(max_users, uniq.shape[0]), replace=False))
        self._lo = np.searchsorted(cu, self.users, side="left")
        self._hi = np.searchsorted(cu, self.users, side="right")
        self.clicks = int((self._hi - self._lo).sum())
        self._scorer: _TrueScorer | None = None

    def prepare(self) -> None:
        if self.world.items.n > self.k:
            self._scorer = _TrueScorer(self.world)

    def chunks(self, n: int) -> list[range]:
        size = -(-self.users.shape[0] // max(1, n))
        return [range(i, min(i + size, self.users.shape[0])) for i in range(0, self.users.shape[0], max(1, size))]

    def hits(self, chunk: range) -> int:
        if self._scorer is None:  # every item is in everyone's top k
            return int(sum(self._hi[i] - self._lo[i] for i in chunk))
        total = 0
        for i in chunk:
            top = self._scorer.top_k(int(self.users[i]), self.k)
            total += int(np.isin(self._clicked_items[self._lo[i]:self._hi[i]], top).sum())
        return total

    def result(self, hits: int) -> RecallResult:
        recall = hits / self.clicks if self.clicks else None
        return RecallResult(recall, int(self.users.shape[0]), self.clicks)


def recall_at_k(world: World, user: np.ndarray, item: np.ndarray, label: np.ndarray, k: int = 500,
                max_users: int = 1000) -> RecallResult:
    oracle = RecallOracle(world, user, item, label, k, max_users)
    oracle.prepare()
    return oracle.result(sum(oracle.hits(c) for c in oracle.chunks(1)))
