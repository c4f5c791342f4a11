"""Interactions, one day at a time: who is shown which item, whether they click, and when.

Interactions are i.i.d. given the world, so each day draws its count (one multinomial over days, up
front) and then its rows from its own stream; sorting the seconds within a day makes the whole table
sorted by timestamp without a global sort, and lets it be written day by day.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recpipe.datagen.click_model import sigmoid
from recpipe.datagen.sampling import PackedTable, gather_dot
from recpipe.datagen.world import S_DAY_COUNTS, S_DAYS, World, rng_for

#: 2024-01-04 00:00:00 UTC, a Thursday: the first day of the data.
EPOCH_START = 1_704_326_400
DAY_SECONDS = 86_400


@dataclass
class DayBatch:
    day: int
    user_id: np.ndarray  # int64
    item_id: np.ndarray  # int64
    label: np.ndarray  # int8
    timestamp: np.ndarray  # int64, non-decreasing
    p_click: np.ndarray  # float64, the true click probability (kept for the oracle, never written)


class InteractionSampler:
    """Draws the interactions of any day independently of the others."""

    def __init__(self, world: World, n: int, days: int) -> None:
        self.world = world
        self.days = days
        rng = rng_for(world.cfg.seed, S_DAY_COUNTS)
        self.day_counts = rng.multinomial(n, world.params.day_weights).astype(np.int64)
        self.day_start = np.concatenate([[0], np.cumsum(self.day_counts)])
        cum_act = np.cumsum(world.users.activity)
        cum_act /= cum_act[-1]
        cum_act[-1] = 1.0
        self._users = PackedTable(cum_act, np.zeros(cum_act.shape[0], np.int64), 1)
        self._cum_hour = np.cumsum(world.params.hour_weights)

    def day(self, d: int) -> DayBatch:
        w = self.world
        users, items, model = w.users, w.items, w.model
        n = int(self.day_counts[d])
        rng = rng_for(w.cfg.seed, S_DAYS, d)
        user = self._users.sample(np.zeros(n, np.int64), self._users.uniforms(rng, n))
        from_pref = rng.random(n) < model.pref_mix
        cat = users.pref[user].astype(np.int64)
        other = np.flatnonzero(~from_pref)
        fine = users.fine[user[other]].astype(np.int64)
        table = w.cat_table
        cat[other] = table.sample(fine, table.uniforms(rng, other.shape[0])) - fine * w.params.n_cat
        # item draws come back sorted by position, so the item-side data is read sequentially
        pos, row = items.table.sample_sorted(cat, items.table.uniforms(rng, n))
        u_of = user[row]
        dot = gather_dot(users.u, u_of, items.v_pos, pos)
        p_sorted = sigmoid(model.logit(dot, items.q_pos[pos], items.cat_pos[pos] == users.pref[u_of]))
        item = np.empty(n, np.int64)
        item[row] = items.order[pos]
        p = np.empty(n, np.float64)
        p[row] = p_sorted
        label = (rng.random(n) < p).astype(np.int8)
        hour = np.minimum(np.searchsorted(self._cum_hour, rng.random(n), side="right"), 23)
        second = np.sort(hour * 3600 + rng.integers(0, 3600, n))
        ts = EPOCH_START + d * DAY_SECONDS + second
        return DayBatch(day=d, user_id=user.astype(np.int64), item_id=item.astype(np.int64), label=label,
                        timestamp=ts.astype(np.int64), p_click=p)
