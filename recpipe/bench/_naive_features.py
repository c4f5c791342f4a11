"""The naive form of feature augmentation that ``recpipe bench features`` times the served gathers
against: per request, filter the raw Polars tables and encode what was found.

Its own module so that building the CLI's parser (every process, the stages included, imports the
bench modules for their flags) never imports Polars: Polars sizes its thread pool at import, before a
stage has applied ``--threads``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from recpipe.types import ItemFeatures, UserFeatures


class NaiveFeatures:
    """The obvious implementation: per request, filter the raw Polars tables and encode what was found."""

    def __init__(self, core: Any, users: pl.DataFrame, items: pl.DataFrame, train: pl.DataFrame) -> None:
        from recpipe.features.core import ITEM_CATEGORY_COLUMN, ITEM_TOP_CATEGORY_COLUMN, USER_CLUSTER_COLUMN

        self.core = core
        self.prep = core.preprocessor
        self.users = users
        self.items = items
        self.history_len = core.history_len
        self.prior = core.history.ctr_prior
        # the interactions with the columns the crosses group by (a table, still filtered per request)
        self.train = (
            train.select("user_id", "item_id", "label")
            .with_row_index("_row")
            .join(items.select("item_id", pl.col(ITEM_CATEGORY_COLUMN).alias("_leaf"),
                               pl.col(ITEM_TOP_CATEGORY_COLUMN).alias("_top")), on="item_id", how="left")
            .join(users.select("user_id", pl.col(USER_CLUSTER_COLUMN).alias("_cluster")), on="user_id", how="left")
            .sort("_row")
        )

    def _user_counts(self, user_id: int) -> tuple[pl.DataFrame, int, int]:
        rows = self.train.filter(pl.col("user_id") == user_id)
        return rows, rows.height, int(rows["label"].sum())

    def augment_user(self, user_id: int) -> UserFeatures:
        from recpipe.features import history as hist

        enc = self.prep.encode("users", self.users.filter(pl.col("user_id") == user_id))
        rows, imp, clk = self._user_counts(user_id)
        agg = hist.user_aggregates(np.array([imp]), np.array([clk]), self.prior)
        recent = rows.filter(pl.col("label") == 1)["item_id"].to_numpy()[::-1][: self.history_len]
        padded = np.full(self.history_len, -1, dtype=np.int64)
        padded[: len(recent)] = recent
        return UserFeatures(user_id, np.concatenate([enc.dense[0], agg[0]]), enc.sparse[0], padded)

    def augment_items(self, user_id: int, item_ids: np.ndarray) -> ItemFeatures:
        from recpipe.features import history as hist
        from recpipe.features.core import USER_CATEGORY_COLUMN, USER_CLUSTER_COLUMN

        wanted = pl.DataFrame({"item_id": item_ids.astype(np.int64)}).with_row_index("_pos")
        found = wanted.join(self.items, on="item_id", how="left").sort("_pos")
        enc = self.prep.encode("items", found)
        item_stats = (
            self.train.filter(pl.col("item_id").is_in(pl.Series(item_ids).implode()))
            .group_by("item_id").agg(pl.len().alias("n"), pl.col("label").sum().alias("c"))
        )
        per_item = wanted.join(item_stats, on="item_id", how="left").sort("_pos").fill_null(0)
        user = self.users.filter(pl.col("user_id") == user_id)
        pref = int(user[USER_CATEGORY_COLUMN][0])
        cluster = int(user[USER_CLUSTER_COLUMN][0])
        mine = self.train.filter(pl.col("user_id") == user_id)
        leaf = mine.group_by("_leaf").agg(pl.len().alias("n"), pl.col("label").sum().alias("c"))
        top = mine.group_by("_top").agg(pl.len().alias("n"), pl.col("label").sum().alias("c"))
        clus = self.train.filter(pl.col("_cluster") == cluster).group_by("_leaf").agg(
            pl.len().alias("n"), pl.col("label").sum().alias("c"))
        cats = found.select(pl.col("_pos"), pl.col("i_cat_00").alias("_leaf"), pl.col("i_cat_01").alias("_top"))

        def counts(frame: pl.DataFrame, on: str) -> tuple[np.ndarray, np.ndarray]:
            j = cats.join(frame, on=on, how="left").sort("_pos").fill_null(0)
            return j["n"].to_numpy(), j["c"].to_numpy()

        crosses = {"leaf": counts(leaf, "_leaf"), "top": counts(top, "_top"), "cluster": counts(clus, "_leaf")}
        match = cats["_leaf"].to_numpy() == pref
        dense = np.concatenate([
            enc.dense,
            hist.item_aggregates(per_item["n"].to_numpy(), per_item["c"].to_numpy(), self.prior),
            hist.cross_features(crosses, match, self.prior),
        ], axis=1)
        return ItemFeatures(item_ids.astype(np.int64), dense.astype(np.float32), enc.sparse)
