"""Per-user history aggregates and user x item cross features, from the training split.

Counts are computed once with Polars and kept as numpy arrays; the transforms below turn counts
into features. Serving uses the counts over the whole training split; a training example uses the
counts of the interactions strictly before it (``prefix_counts``), so no example sees its own label
or the future — and the same transform turns either into features, so they cannot drift.
(Leave-one-out counts were tried first: for rarely seen items they anti-correlate with the label.)

Feature blocks (all float32):
- user aggregates (3): log1p impressions, log1p clicks, smoothed click-rate lift;
- item aggregates (2): log1p impressions (popularity), smoothed click-rate lift;
- cross (9): for the user in the item's leaf category and in its top-level category, and for the
  user's fine interest cluster in the item's leaf category: log1p impressions, log1p clicks, smoothed
  click-rate lift; plus whether the item's leaf category is the user's preferred one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import polars as pl

USER_AGGREGATES: tuple[str, ...] = ("user_log_impressions", "user_log_clicks", "user_ctr_lift")
ITEM_AGGREGATES: tuple[str, ...] = ("item_log_impressions", "item_ctr_lift")
#: the keyed count tables behind the cross features: user x leaf, user x top-level, cluster x leaf
CROSSES: tuple[str, ...] = ("leaf", "top", "cluster")
CROSS_FEATURES: tuple[str, ...] = (
    *(f"{c}_{f}" for c in CROSSES for f in ("log_impressions", "log_clicks", "ctr_lift")),
    "pref_leaf_match",
)
#: pseudo-impressions at the global click rate that shrink small-count click rates towards it
SMOOTHING = 20.0


def ctr_lift(impressions: np.ndarray, clicks: np.ndarray, prior: float) -> np.ndarray:
    """log of the smoothed click rate over the global one; 0 for no history."""
    rate = (clicks + SMOOTHING * prior) / (impressions + SMOOTHING)
    return np.log(rate / prior)


def _block(impressions: np.ndarray, clicks: np.ndarray, prior: float) -> list[np.ndarray]:
    imp = impressions.astype(np.float64)
    clk = clicks.astype(np.float64)
    return [np.log1p(imp), np.log1p(clk), ctr_lift(imp, clk, prior)]


def user_aggregates(impressions: np.ndarray, clicks: np.ndarray, prior: float) -> np.ndarray:
    """(n,) counts -> (n, 3) float32."""
    return np.stack(_block(impressions, clicks, prior), axis=1).astype(np.float32)


def item_aggregates(impressions: np.ndarray, clicks: np.ndarray, prior: float) -> np.ndarray:
    """(n,) counts -> (n, 2) float32 (log impressions, click-rate lift)."""
    b = _block(impressions, clicks, prior)
    return np.stack([b[0], b[2]], axis=1).astype(np.float32)


def cross_features(counts: dict[str, tuple[np.ndarray, np.ndarray]], match: np.ndarray, prior: float) -> np.ndarray:
    """{cross: (impressions, clicks)} (n,) each + (n,) preferred-leaf match -> (n, 10) float32."""
    cols: list[np.ndarray] = []
    for c in CROSSES:
        cols += _block(*counts[c], prior)
    cols.append(match.astype(np.float64))
    return np.stack(cols, axis=1).astype(np.float32)


@dataclass(frozen=True)
class CrossKeys:
    """Raw ids that key the cross tables: item leaf / top-level category, user fine interest cluster."""

    item_leaf: np.ndarray
    item_top: np.ndarray
    user_cluster: np.ndarray
    num_leaf: int
    num_top: int

    def keys(self, users: np.ndarray, items: np.ndarray) -> dict[str, np.ndarray]:
        leaf = self.item_leaf[items]
        return {
            "leaf": users * self.num_leaf + leaf,
            "top": users * self.num_top + self.item_top[items],
            "cluster": self.user_cluster[users] * self.num_leaf + leaf,
        }


@dataclass(frozen=True)
class CountTable:
    """Impressions and clicks per int64 key, keys sorted for ``searchsorted`` lookups."""

    keys: np.ndarray
    impressions: np.ndarray
    clicks: np.ndarray

    @classmethod
    def from_rows(cls, keys: np.ndarray, labels: np.ndarray) -> CountTable:
        agg = (
            pl.DataFrame({"k": keys, "y": labels})
            .group_by("k")
            .agg(pl.len().alias("n"), pl.col("y").sum().alias("c"))
            .sort("k")
        )
        return cls(agg["k"].to_numpy().astype(np.int64), agg["n"].to_numpy().astype(np.int64),
                   agg["c"].to_numpy().astype(np.int64))

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(impressions, clicks) per key, 0 for keys never seen."""
        if self.keys.shape[0] == 0:
            zero = np.zeros(keys.shape[0], np.int64)
            return zero, zero
        pos = np.minimum(np.searchsorted(self.keys, keys), self.keys.shape[0] - 1)
        found = self.keys[pos] == keys
        return np.where(found, self.impressions[pos], 0), np.where(found, self.clicks[pos], 0)


@dataclass(frozen=True)
class RowCounts:
    """Per example: impressions/clicks of its user, its item and each cross, from strictly earlier rows."""

    user_impressions: np.ndarray
    user_clicks: np.ndarray
    item_impressions: np.ndarray
    item_clicks: np.ndarray
    leaf_impressions: np.ndarray
    leaf_clicks: np.ndarray
    top_impressions: np.ndarray
    top_clicks: np.ndarray
    cluster_impressions: np.ndarray
    cluster_clicks: np.ndarray

    def take(self, rows: np.ndarray) -> RowCounts:
        return RowCounts(*(getattr(self, f.name)[rows] for f in fields(self)))

    def crosses(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return {c: (getattr(self, f"{c}_impressions"), getattr(self, f"{c}_clicks")) for c in CROSSES}


def prefix_counts(train: pl.DataFrame, cross: CrossKeys) -> RowCounts:
    """For each row of ``train`` (timestamp order), the counts over the rows before it."""
    users = train["user_id"].to_numpy().astype(np.int64)
    items = train["item_id"].to_numpy().astype(np.int64)
    frame = pl.DataFrame({"user": users, "item": items, "label": train["label"].to_numpy().astype(np.int64),
                          **cross.keys(users, items)})
    before = {}
    for key in ("user", "item", *CROSSES):
        before[f"{key}_impressions"] = pl.int_range(pl.len(), dtype=pl.Int64).over(key)
        before[f"{key}_clicks"] = (pl.col("label").cum_sum() - pl.col("label")).over(key)
    out = frame.select(**before)
    return RowCounts(**{k: out[k].to_numpy() for k in before})


@dataclass(frozen=True)
class History:
    """Counts over the training split, laid out for gathers by position.

    ``recent`` (num_users, H): the user's last H clicked items, newest first, -1 padded.
    """

    ctr_prior: float
    user_impressions: np.ndarray
    user_clicks: np.ndarray
    item_impressions: np.ndarray
    item_clicks: np.ndarray
    crosses: dict[str, CountTable]
    recent: np.ndarray

    @classmethod
    def compute(cls, train: pl.DataFrame, cross: CrossKeys, num_users: int, history_len: int) -> History:
        """``train``: (user_id, item_id, label, timestamp) in timestamp order."""
        num_items = int(cross.item_leaf.shape[0])
        users = train["user_id"].to_numpy().astype(np.int64)
        items = train["item_id"].to_numpy().astype(np.int64)
        labels = train["label"].to_numpy().astype(np.int64)
        keys = cross.keys(users, items)
        recent = np.full((num_users, history_len), -1, dtype=np.int64)
        if history_len > 0:
            clicked = (
                pl.DataFrame({"user_id": users, "item_id": items, "label": labels})
                .filter(pl.col("label") == 1)
                .with_columns(pl.int_range(pl.len()).reverse().over("user_id").alias("_pos"))
                .filter(pl.col("_pos") < history_len)
            )
            recent[clicked["user_id"].to_numpy(), clicked["_pos"].to_numpy()] = clicked["item_id"].to_numpy()
        prior = float(min(max(labels.sum() / max(1, len(labels)), 1e-4), 1 - 1e-4))
        return cls(
            ctr_prior=prior,
            user_impressions=np.bincount(users, minlength=num_users).astype(np.int64),
            user_clicks=np.bincount(users, weights=labels, minlength=num_users).astype(np.int64),
            item_impressions=np.bincount(items, minlength=num_items).astype(np.int64),
            item_clicks=np.bincount(items, weights=labels, minlength=num_items).astype(np.int64),
            crosses={c: CountTable.from_rows(keys[c], labels) for c in CROSSES},
            recent=recent,
        )

    def cross_counts(self, cross: CrossKeys, users: np.ndarray, items: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        keys = cross.keys(users, items)
        return {c: self.crosses[c].lookup(keys[c]) for c in CROSSES}
