"""The feature-augmentation core: encoded user/item rows and history aggregates, gathered by position.

At load time the users and items tables are encoded whole with the fitted preprocessing (the same
Polars expressions training used) and the history counts are computed from the training split; a
request is then a handful of numpy gathers. Training builds its examples through the same object
(``user_dense_rows`` / ``item_dense_rows`` with the rows' own labels for leave-one-out), so one code
path serves a request and builds the training set.

Shapes: ``UserFeatures.dense`` (Du,) = 40 encoded continuous + 3 user aggregates; ``sparse`` (44,);
``recent_items`` (H,). ``ItemFeatures.dense`` (k, Di) = 20 encoded continuous + 2 item aggregates +
10 user x item cross features (``history.CROSS_FEATURES``); ``sparse`` (k, 16).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from recpipe import schema
from recpipe.config import MAX_NUM_CANDIDATES
from recpipe.errors import ArtifactMismatch
from recpipe.features import history as hist
from recpipe.features.artifacts import CONFIG_FILE, FeatureConfig, load_config, load_preprocessor, load_rows
from recpipe.features.contract import FeatureLimits, ItemsQuery, UserQuery
from recpipe.preprocess import Preprocessor
from recpipe.types import ItemFeatures, UserFeatures

log = logging.getLogger(__name__)

USER_CATEGORY_COLUMN = "u_cat_11"  # preferred leaf category
USER_CLUSTER_COLUMN = "u_cat_23"  # fine interest cluster
ITEM_CATEGORY_COLUMN = "i_cat_00"  # leaf category
ITEM_TOP_CATEGORY_COLUMN = "i_cat_01"  # top-level category

def _check_ids(frame: pl.DataFrame, column: str, path: str) -> None:
    ids = frame[column].to_numpy()
    if not np.array_equal(ids, np.arange(ids.shape[0])):
        raise ArtifactMismatch(f"{path}: {column} must be 0..n-1 in row order")


def read_tables(data_dir: Path) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """users, items, interactions from a dataset directory (a missing/unreadable file names itself)."""
    frames = []
    for table in schema.TABLES:
        path = Path(data_dir) / schema.TABLE_FILES[table.name]
        try:
            frame = pl.read_parquet(path)
        except FileNotFoundError:
            raise ArtifactMismatch(f"{path}: dataset file is missing") from None
        except Exception as e:
            raise ArtifactMismatch(f"{path}: unreadable Parquet ({e})") from None
        missing = [c for c in table.column_names if c not in frame.columns]
        if missing:
            raise ArtifactMismatch(f"{path}: missing columns {missing[:5]}")
        frames.append(frame)
    return frames[0], frames[1], frames[2]


class FeatureCore:
    """Encoded users/items + history, gathered per request or per training batch."""

    def __init__(
        self,
        preprocessor: Preprocessor,
        users: pl.DataFrame,
        items: pl.DataFrame,
        train: pl.DataFrame,
        config: FeatureConfig,
        model_version: str = "",
    ) -> None:
        _check_ids(users, "user_id", schema.TABLE_FILES["users"])
        _check_ids(items, "item_id", schema.TABLE_FILES["items"])
        self.preprocessor = preprocessor
        self.model_version = model_version
        self.num_users = users.height
        self.num_items = items.height
        self.history_len = config.history_len
        def raw(frame: pl.DataFrame, column: str) -> np.ndarray:
            return np.maximum(frame[column].fill_null(0).to_numpy().astype(np.int64), 0)

        user_cat = raw(users, USER_CATEGORY_COLUMN)
        item_cat = raw(items, ITEM_CATEGORY_COLUMN)
        item_top = raw(items, ITEM_TOP_CATEGORY_COLUMN)
        num_categories = config.num_categories or int(max(user_cat.max(initial=0), item_cat.max(initial=0)) + 1)
        num_top = config.num_top_categories or int(item_top.max(initial=0) + 1)
        if user_cat.max(initial=0) >= num_categories or item_cat.max(initial=0) >= num_categories \
                or item_top.max(initial=0) >= num_top:
            raise ArtifactMismatch(f"{CONFIG_FILE}: category id ranges are below the data's category ids")
        self.config = FeatureConfig(config.history_len, num_categories, num_top)
        self.user_category = user_cat
        self.item_category = item_cat
        self.cross_keys = hist.CrossKeys(item_cat, item_top, raw(users, USER_CLUSTER_COLUMN), num_categories, num_top)

        enc_users = preprocessor.encode("users", users)
        enc_items = preprocessor.encode("items", items)
        self.user_continuous = enc_users.dense
        self.user_sparse = enc_users.sparse
        self.item_continuous = enc_items.dense
        self.item_sparse = enc_items.sparse
        self.history = hist.History.compute(train, self.cross_keys, self.num_users, config.history_len)
        prior = self.history.ctr_prior
        h = self.history
        # Serving rows: everything that depends on the user or the item alone, computed once.
        self.user_dense = np.ascontiguousarray(
            np.concatenate([self.user_continuous, hist.user_aggregates(h.user_impressions, h.user_clicks, prior)], 1)
        )
        self.item_base = np.ascontiguousarray(
            np.concatenate([self.item_continuous, hist.item_aggregates(h.item_impressions, h.item_clicks, prior)], 1)
        )
        self.user_dense_dim = int(self.user_dense.shape[1])
        self.item_base_dim = int(self.item_base.shape[1])
        self.item_dense_dim = self.item_base_dim + len(hist.CROSS_FEATURES)

    # ---- construction ------------------------------------------------------------------------------

    @classmethod
    def load(cls, models_dir: Path, data_dir: Path, threads: int | None = None) -> FeatureCore:
        """Load the preprocessing from ``models_dir`` and encode the dataset in ``data_dir``.

        Polars' thread pool is sized when Polars is first imported: set ``POLARS_MAX_THREADS`` in the
        process environment before that; ``threads`` here is checked against it and logged.
        """
        from recpipe.datagen.manifest import verify as verify_dataset
        from recpipe.repository import Repository
        from recpipe.timesplit import split_by_time

        if threads is not None and threads != pl.thread_pool_size():
            log.warning("Polars uses %d threads (set POLARS_MAX_THREADS=%d before start-up to change it)",
                        pl.thread_pool_size(), threads)
        repo = Repository.open(Path(models_dir))
        repo.check_dataset(Path(data_dir))
        preprocessor = load_preprocessor(repo)
        config = load_config(repo)
        # the rows below were computed from these files: a changed file is refused either way
        verify_dataset(Path(data_dir), [schema.TABLE_FILES[t.name] for t in schema.TABLES])
        rows = load_rows(repo)
        if rows is not None:  # computed once by `recpipe train`: no Parquet read, nothing encoded here
            core = cls.from_rows(preprocessor, config, *rows, model_version=repo.version)
        else:
            users, items, interactions = read_tables(Path(data_dir))
            train, _ = split_by_time(interactions)
            core = cls(preprocessor, users, items, train, config, repo.version)
        shapes = repo.section("shapes")
        for key, have in (("num_users", core.num_users), ("num_items", core.num_items),
                          ("user_dense_dim", core.user_dense_dim), ("item_dense_dim", core.item_dense_dim)):
            if int(shapes.get(key, -1)) != have:
                raise ArtifactMismatch(
                    f"{repo.root / 'manifest.json'}: shapes.{key} = {shapes.get(key)} but the data gives {have}"
                )
        core.warm()
        return core

    def warm(self) -> None:
        """Augment one user and 1, 500 and 10,000 items once before the stage serves: a fresh stage's
        first calls paid for the first touch of its rows and numpy's first gathers (3-4x the second)."""
        self.augment_user(0)
        for n in (1, 500, MAX_NUM_CANDIDATES):
            self.augment_items(0, np.arange(n, dtype=np.int64) % self.num_items)

    _ROW_ARRAYS = ("user_category", "item_category", "user_sparse", "item_sparse", "user_dense", "item_base")

    def rows(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Everything a request reads, as arrays + string metadata (``features.artifacts.save_rows``).
        The encoded continuous columns are the leading columns of ``user_dense``/``item_base``."""
        h, c = self.history, self.cross_keys
        arrays = {name: getattr(self, name) for name in self._ROW_ARRAYS}
        arrays |= {"cross.item_top": c.item_top, "cross.user_cluster": c.user_cluster, "history.recent": h.recent}
        arrays |= {f"history.{n}": getattr(h, n) for n in
                   ("user_impressions", "user_clicks", "item_impressions", "item_clicks")}
        for name, table in h.crosses.items():
            arrays |= {f"crosses.{name}.{n}": getattr(table, n) for n in ("keys", "impressions", "clicks")}
        meta = {"config": json.dumps(asdict(self.config)), "ctr_prior": repr(h.ctr_prior),
                "user_continuous_dim": str(self.user_continuous.shape[1]),
                "item_continuous_dim": str(self.item_continuous.shape[1]), "crosses": ",".join(h.crosses)}
        return arrays, meta

    @classmethod
    def from_rows(cls, preprocessor: Preprocessor, config: FeatureConfig, arrays: dict[str, np.ndarray],
                  meta: dict[str, str], model_version: str = "") -> FeatureCore:
        """The core ``rows()`` describes (the same arrays, read-only), without the dataset."""
        path = f"{CONFIG_FILE.rsplit('/', 1)[0]}/rows.safetensors"
        try:
            saved = FeatureConfig(**json.loads(meta["config"]))
            if saved != config:
                raise ArtifactMismatch(f"{path}: written for {saved}, {CONFIG_FILE} says {config}")
            self = cls.__new__(cls)
            for name in cls._ROW_ARRAYS:
                setattr(self, name, arrays[name])
            crosses = {n: hist.CountTable(*(arrays[f"crosses.{n}.{f}"] for f in ("keys", "impressions", "clicks")))
                       for n in meta["crosses"].split(",") if n}
            self.history = hist.History(
                ctr_prior=float(meta["ctr_prior"]), user_impressions=arrays["history.user_impressions"],
                user_clicks=arrays["history.user_clicks"], item_impressions=arrays["history.item_impressions"],
                item_clicks=arrays["history.item_clicks"], crosses=crosses, recent=arrays["history.recent"])
            self.user_continuous = self.user_dense[:, : int(meta["user_continuous_dim"])]
            self.item_continuous = self.item_base[:, : int(meta["item_continuous_dim"])]
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactMismatch(f"{path}: malformed ({e!r})") from None
        self.cross_keys = hist.CrossKeys(self.item_category, arrays["cross.item_top"], arrays["cross.user_cluster"],
                                         saved.num_categories, saved.num_top_categories)
        self.preprocessor = preprocessor
        self.model_version = model_version
        self.num_users = int(self.user_dense.shape[0])
        self.num_items = int(self.item_base.shape[0])
        self.history_len = saved.history_len
        self.config = saved
        self.user_dense_dim = int(self.user_dense.shape[1])
        self.item_base_dim = int(self.item_base.shape[1])
        self.item_dense_dim = self.item_base_dim + len(hist.CROSS_FEATURES)
        return self

    def describe(self) -> dict[str, Any]:
        return {"num_users": self.num_users, "num_items": self.num_items, "user_dense_dim": self.user_dense_dim,
                "item_dense_dim": self.item_dense_dim, "history_len": self.history_len,
                "num_categories": self.config.num_categories, "num_top_categories": self.config.num_top_categories}

    # ---- requests ----------------------------------------------------------------------------------

    @property
    def limits(self) -> FeatureLimits:
        return FeatureLimits(self.num_users, self.num_items)

    def augment_user(self, user_id: int) -> UserFeatures:
        """The user's encoded features (``user_id`` checked by ``UserQuery``)."""
        return self.user_features(UserQuery.checked(user_id, self.limits))

    def augment_items(self, user_id: int, item_ids: np.ndarray) -> ItemFeatures:
        """k items' encoded features for the user (checked by ``ItemsQuery``)."""
        return self.items_batch([ItemsQuery.checked(user_id, item_ids, self.limits)])[0]

    def user_features(self, query: UserQuery) -> UserFeatures:
        uid = query.user_id
        return UserFeatures(
            user_id=uid,
            dense=self.user_dense[uid].copy(),
            sparse=self.user_sparse[uid].copy(),
            recent_items=self.history.recent[uid].copy(),
        )

    def items_batch(self, queries: Sequence[ItemsQuery]) -> list[ItemFeatures]:
        """One gather for all the queries' (user, item) pairs, split back per query."""
        if len(queries) == 1:
            q = queries[0]
            users = np.full(q.item_ids.shape[0], q.user_id, dtype=np.int64)
            return [ItemFeatures(q.item_ids.copy(), self.item_dense_rows(users, q.item_ids), self.item_sparse[q.item_ids])]
        counts = [q.item_ids.shape[0] for q in queries]
        ids = np.concatenate([q.item_ids for q in queries])
        users = np.repeat(np.fromiter((q.user_id for q in queries), np.int64, len(queries)), counts)
        dense = self.item_dense_rows(users, ids)
        sparse = self.item_sparse[ids]
        out, start = [], 0
        for n in counts:
            end = start + n
            out.append(ItemFeatures(ids[start:end], dense[start:end], sparse[start:end]))
            start = end
        return out

    # ---- bulk gathers (requests and training examples alike) ---------------------------------------

    def user_dense_rows(self, user_ids: np.ndarray, counts: hist.RowCounts | None = None) -> np.ndarray:
        """(n, Du) user dense rows; ``counts`` (training examples) replace the serving history counts."""
        if counts is None:
            return self.user_dense[user_ids]
        agg = hist.user_aggregates(counts.user_impressions, counts.user_clicks, self.history.ctr_prior)
        return np.concatenate([self.user_continuous[user_ids], agg], axis=1)

    def item_base_rows(self, item_ids: np.ndarray, counts: hist.RowCounts | None = None) -> np.ndarray:
        """(n, Di - 4) user-independent item rows (encoded continuous + item aggregates), as the item tower sees them."""
        if counts is None:
            return self.item_base[item_ids]
        agg = hist.item_aggregates(counts.item_impressions, counts.item_clicks, self.history.ctr_prior)
        return np.concatenate([self.item_continuous[item_ids], agg], axis=1)

    def item_dense_rows(
        self, user_ids: np.ndarray, item_ids: np.ndarray, counts: hist.RowCounts | None = None
    ) -> np.ndarray:
        """(n, Di) item rows + user x item cross features for paired (user, item) arrays."""
        h = self.history
        crosses = h.cross_counts(self.cross_keys, user_ids, item_ids) if counts is None else counts.crosses()
        match = self.user_category[user_ids] == self.item_category[item_ids]
        cross = hist.cross_features(crosses, match, h.ctr_prior)
        return np.concatenate([self.item_base_rows(item_ids, counts), cross], axis=1)

    def training_counts(self, train: pl.DataFrame) -> hist.RowCounts:
        """Strictly-earlier history counts for each row of ``train`` (the split this core was built on)."""
        return hist.prefix_counts(train, self.cross_keys)
