"""Feature augmentation: O(1) gathers from laid-out arrays vs filtering the Polars tables per request.

Both forms use the same fitted preprocessing (Polars expressions) and history definitions, and the
benchmark checks that they return the same features before timing them. Queries alternate between
the forms so both see the same machine noise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from recpipe.bench._args import at_least, require_dirs
from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_MODELS_DIR, DEFAULT_NUM_CANDIDATES
from recpipe.types import ItemFeatures, UserFeatures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR))
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--items", type=int, default=DEFAULT_NUM_CANDIDATES, help="items per AugmentItems call")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    at_least(1, ("--queries", args.queries), ("--items", args.items))
    at_least(0, ("--warmup", args.warmup), ("--seed", args.seed))
    require_dirs(("--models", args.models), ("--data", args.data))
    import polars as pl

    from recpipe.bench._naive_features import NaiveFeatures
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
