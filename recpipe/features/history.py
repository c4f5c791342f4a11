"""Per-user history aggregates and user x item cross features, from the training split.

Counts are computed once with Polars and kept as numpy arrays; the transforms below turn counts
into features. Training passes each row's own label to subtract that row's contribution
(leave-one-out), serving passes nothing — the same transform either way, so the features a model
was trained on and the ones it is served cannot drift, and no training row sees its own label.

Feature blocks (all float32):
- user aggregates (3): log1p impressions, log1p clicks, smoothed click-rate lift;
- item aggregates (2): log1p impressions (popularity), smoothed click-rate lift;
- cross (4): log1p impressions and clicks of the user in the item's leaf category, the smoothed
  click-rate lift there, and whether the item's leaf category is the user's preferred one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

USER_AGGREGATES: tuple[str, ...] = ("user_log_impressions", "user_log_clicks", "user_ctr_lift")
ITEM_AGGREGATES: tuple[str, ...] = ("item_log_impressions", "item_ctr_lift")
CROSS_FEATURES: tuple[str, ...] = ("cat_log_impressions", "cat_log_clicks", "cat_ctr_lift", "pref_cat_match")
#: pseudo-impressions at the global click rate that shrink small-count click rates towards it
SMOOTHING = 20.0


def ctr_lift(impressions: np.ndarray, clicks: np.ndarray, prior: float) -> np.ndarray:
    """log of the smoothed click rate over the global one; 0 for no history."""
    rate = (clicks + SMOOTHING * prior) / (impressions + SMOOTHING)
    return np.log(rate / prior)


def user_aggregates(impressions: np.ndarray, clicks: np.ndarray, prior: float) -> np.ndarray:
    """(n,) counts -> (n, 3) float32."""
    imp = impressions.astype(np.float64)
    clk = clicks.astype(np.float64)
    return np.stack([np.log1p(imp), np.log1p(clk), ctr_lift(imp, clk, prior)], axis=1).astype(np.float32)


def item_aggregates(impressions: np.ndarray, clicks: np.ndarray, prior: float) -> np.ndarray:
    """(n,) counts -> (n, 2) float32."""
    imp = impressions.astype(np.float64)
    clk = clicks.astype(np.float64)
    return np.stack([np.log1p(imp), ctr_lift(imp, clk, prior)], axis=1).astype(np.float32)


def cross_features(impressions: np.ndarray, clicks: np.ndarray, match: np.ndarray, prior: float) -> np.ndarray:
    """(n,) user-in-category counts + (n,) bool preferred-category match -> (n, 4) float32."""
    imp = impressions.astype(np.float64)
    clk = clicks.astype(np.float64)
    return np.stack(
        [np.log1p(imp), np.log1p(clk), ctr_lift(imp, clk, prior), match.astype(np.float64)], axis=1
    ).astype(np.float32)


@dataclass(frozen=True)
class History:
    """Counts over the training split, laid out for gathers by position.

    ``uc_keys`` (m,) sorted int64 = user_id * num_categories + leaf category, with ``uc_impressions``
    and ``uc_clicks``; ``recent`` (num_users, H) the user's last H clicked items, newest first, -1 padded.
    """

    num_categories: int
    ctr_prior: float
    user_impressions: np.ndarray
    user_clicks: np.ndarray
    item_impressions: np.ndarray
    item_clicks: np.ndarray
    uc_keys: np.ndarray
    uc_impressions: np.ndarray
    uc_clicks: np.ndarray
    recent: np.ndarray

    @classmethod
    def compute(
        cls,
        train: pl.DataFrame,
        item_category: np.ndarray,
        num_users: int,
        history_len: int,
        num_categories: int,
    ) -> History:
        """``train``: (user_id, item_id, label, timestamp) in timestamp order; ``item_category`` raw leaf ids."""
        num_items = int(item_category.shape[0])
        frame = train.select(
            pl.col("user_id").cast(pl.Int64),
            pl.col("item_id").cast(pl.Int64),
            pl.col("label").cast(pl.Int64),
        )
        users = frame["user_id"].to_numpy()
        items = frame["item_id"].to_numpy()
        labels = frame["label"].to_numpy()
        user_imp = np.bincount(users, minlength=num_users).astype(np.int64)
        user_clk = np.bincount(users, weights=labels, minlength=num_users).astype(np.int64)
        item_imp = np.bincount(items, minlength=num_items).astype(np.int64)
        item_clk = np.bincount(items, weights=labels, minlength=num_items).astype(np.int64)
        keys = users * num_categories + item_category[items].astype(np.int64)
        agg = (
            pl.DataFrame({"k": keys, "y": labels})
            .group_by("k")
            .agg(pl.len().alias("n"), pl.col("y").sum().alias("c"))
            .sort("k")
        )
        recent = np.full((num_users, history_len), -1, dtype=np.int64)
        if history_len > 0:
            clicked = (
                frame.with_row_index("_row")
                .filter(pl.col("label") == 1)
                .with_columns(pl.int_range(pl.len()).reverse().over("user_id").alias("_pos"))
                .filter(pl.col("_pos") < history_len)
            )
            recent[clicked["user_id"].to_numpy(), clicked["_pos"].to_numpy()] = clicked["item_id"].to_numpy()
        n = max(1, len(labels))
        prior = float(min(max(labels.sum() / n, 1e-4), 1 - 1e-4))
        return cls(
            num_categories=num_categories,
            ctr_prior=prior,
            user_impressions=user_imp,
            user_clicks=user_clk,
            item_impressions=item_imp,
            item_clicks=item_clk,
            uc_keys=agg["k"].to_numpy().astype(np.int64),
            uc_impressions=agg["n"].to_numpy().astype(np.int64),
            uc_clicks=agg["c"].to_numpy().astype(np.int64),
            recent=recent,
        )

    def user_category_counts(self, user_ids: np.ndarray, categories: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n,) impressions and clicks of each user in the paired category (0 when never seen)."""
        keys = user_ids.astype(np.int64) * self.num_categories + categories.astype(np.int64)
        pos = np.searchsorted(self.uc_keys, keys)
        pos = np.minimum(pos, max(0, self.uc_keys.shape[0] - 1))
        if self.uc_keys.shape[0] == 0:
            zero = np.zeros(keys.shape[0], np.int64)
            return zero, zero
        found = self.uc_keys[pos] == keys
        return np.where(found, self.uc_impressions[pos], 0), np.where(found, self.uc_clicks[pos], 0)
