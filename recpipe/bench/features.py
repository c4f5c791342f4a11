"""Feature augmentation: O(1) gathers from laid-out arrays vs filtering the Polars tables per request.

Both forms use the same fitted preprocessing (Polars expressions) and history definitions, and the
benchmark checks that they return the same features before timing them. Queries alternate between
the forms so both see the same machine noise.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from recpipe.bench._args import require_dirs
from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_MODELS_DIR, DEFAULT_NUM_CANDIDATES
from recpipe.errors import UsageError
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR))
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--items", type=int, default=DEFAULT_NUM_CANDIDATES, help="items per AugmentItems call")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.queries < 1 or args.warmup < 0 or args.items < 1:
        raise UsageError("--queries and --items must be >= 1, --warmup >= 0")
    require_dirs(("--models", args.models), ("--data", args.data))
    from recpipe.bench._timing import measure_interleaved, table
    from recpipe.features.core import FeatureCore, read_tables
    from recpipe.timesplit import split_by_time

    core = FeatureCore.load(args.models, args.data)
    users, items, interactions = read_tables(args.data)
    train, _ = split_by_time(interactions)
    naive = NaiveFeatures(core, users, items, train)
    rng = np.random.default_rng(args.seed)
    n = args.queries + args.warmup
    user_ids = rng.integers(0, core.num_users, n)
    k = min(args.items, core.num_items)
    item_ids = [rng.choice(core.num_items, k, replace=False) for _ in range(n)]
    for i in range(3):
        check_same(core.augment_user(int(user_ids[i])), naive.augment_user(int(user_ids[i])))
        check_same(core.augment_items(int(user_ids[i]), item_ids[i]), naive.augment_items(int(user_ids[i]), item_ids[i]))
    print(f"features bench: {core.num_users} users, {core.num_items} items, {train.height} training interactions, "
          f"{args.queries} queries, Polars threads {pl.thread_pool_size()}")
    user_t = measure_interleaved(
        [("augment_user naive (filter+encode)", lambda i: naive.augment_user(int(user_ids[i]))),
         ("augment_user gather", lambda i: core.augment_user(int(user_ids[i])))],
        args.queries, args.warmup)
    print(table(user_t, "augment_user naive (filter+encode)"))
    item_t = measure_interleaved(
        [(f"augment_items naive k={k}", lambda i: naive.augment_items(int(user_ids[i]), item_ids[i])),
         (f"augment_items gather k={k}", lambda i: core.augment_items(int(user_ids[i]), item_ids[i]))],
        args.queries, args.warmup, rows_per_call=k)
    print(table(item_t, f"augment_items naive k={k}"))
    return 0


def check_same(a: UserFeatures | ItemFeatures, b: UserFeatures | ItemFeatures) -> None:
    """The two forms must agree (float tolerance: aggregates are computed in a different order)."""
    np.testing.assert_allclose(a.dense, b.dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(a.sparse, b.sparse)
    if isinstance(a, UserFeatures) and isinstance(b, UserFeatures):
        np.testing.assert_array_equal(a.recent_items, b.recent_items)
