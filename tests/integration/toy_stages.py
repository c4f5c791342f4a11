"""Small stage cores with simple, real numpy logic, for testing the serving infrastructure and the
gateway without a trained model repository. They satisfy the ``*CoreLike`` protocols the real
servicers are written against, so every test here runs the real servicers, server and gateway.

``delay_s`` makes a core slow (for deadline and drain tests; with ``workers=0`` the stage runs such a
call on a thread once it has seen one, and the first call always: ``recpipe.serving.inline``);
``fail_with`` makes ``augment_user`` raise a chosen exception.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from recpipe import schema
from recpipe.features.contract import FeatureLimits, ItemsQuery, UserQuery
from recpipe.ranking.contract import RankingLimits, RankQuery
from recpipe.retrieval.contract import RetrievalLimits, RetrieveQuery
from recpipe.types import Candidates, ItemFeatures, UserFeatures

USER_SPARSE = len(schema.USER_CATEGORICAL)
ITEM_SPARSE = len(schema.ITEM_CATEGORICAL)


class ToyWorld:
    """Seeded user/item factors shared by the three toy cores."""

    def __init__(self, num_users: int = 60, num_items: int = 400, dim: int = 8, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.num_users = num_users
        self.num_items = num_items
        self.user_dense = rng.normal(size=(num_users, dim)).astype(np.float32)
        self.item_emb = rng.normal(size=(num_items, dim)).astype(np.float32)
        self.item_dense = rng.normal(size=(num_items, 5)).astype(np.float32)
        self.user_sparse = rng.integers(0, 3, size=(num_users, USER_SPARSE), dtype=np.int64)
        self.item_sparse = rng.integers(0, 3, size=(num_items, ITEM_SPARSE), dtype=np.int64)
        self.history_len = 4
        self.model_version = "toy-1"


class ToyFeatureCore:
    def __init__(self, world: ToyWorld) -> None:
        self.w = world
        self.num_users = world.num_users
        self.num_items = world.num_items
        self.model_version = world.model_version
        self.user_dense_dim = world.user_dense.shape[1]
        self.item_dense_dim = world.item_dense.shape[1] + 1
        self.history_len = world.history_len
        self.delay_s = 0.0
        self.fail_with: BaseException | None = None

    @property
    def limits(self) -> FeatureLimits:
        return FeatureLimits(self.num_users, self.num_items)

    def user_features(self, query: UserQuery) -> UserFeatures:
        if self.fail_with is not None:
            raise self.fail_with
        if self.delay_s:
            time.sleep(self.delay_s)
        user_id = query.user_id
        recent = np.full(self.history_len, -1, dtype=np.int64)
        recent[:2] = [user_id % self.num_items, (user_id * 7) % self.num_items]
        return UserFeatures(user_id, self.w.user_dense[user_id], self.w.user_sparse[user_id], recent)

    def items_batch(self, queries: Sequence[ItemsQuery]) -> list[ItemFeatures]:
        return [self._items(q.user_id, q.item_ids) for q in queries]

    def _items(self, user_id: int, item_ids: np.ndarray) -> ItemFeatures:
        cross = (self.w.item_emb[item_ids] @ self.w.user_dense[user_id])[:, None]
        dense = np.concatenate([self.w.item_dense[item_ids], cross], axis=1).astype(np.float32)
        return ItemFeatures(item_ids, dense, self.w.item_sparse[item_ids])


class ToyRetrievalCore:
    def __init__(self, world: ToyWorld) -> None:
        self.w = world
        self.device = "cpu"
        self.model_version = world.model_version
        self.num_items = world.num_items
        self.user_dense_dim = world.user_dense.shape[1]
        self.history_len = world.history_len
        self.details = {"index": "exact inner product"}

    @property
    def limits(self) -> RetrievalLimits:
        return RetrievalLimits(self.user_dense_dim, np.full(USER_SPARSE, 3, dtype=np.int64), self.num_items)

    def retrieve_batch(self, queries: Sequence[RetrieveQuery]) -> list[Candidates]:
        return [self._retrieve(q.dense, q.k) for q in queries]

    def _retrieve(self, dense: np.ndarray, k: int) -> Candidates:
        scores = self.w.item_emb @ dense
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top])]
        return Candidates(top.astype(np.int64), scores[top].astype(np.float32))


class ToyRankingCore:
    def __init__(self, world: ToyWorld) -> None:
        self.device = "cpu"
        self.model_version = world.model_version
        self.user_dense_dim = world.user_dense.shape[1]
        self.item_dense_dim = world.item_dense.shape[1] + 1
        self.delay_s = 0.0

    @property
    def limits(self) -> RankingLimits:
        return RankingLimits(self.user_dense_dim, self.item_dense_dim, np.full(USER_SPARSE, 3, dtype=np.int64),
                             np.full(ITEM_SPARSE, 3, dtype=np.int64))

    def rank_batch(self, queries: Sequence[RankQuery]) -> list[np.ndarray]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return [self._rank(q.user_dense, q.item_dense) for q in queries]

    @staticmethod
    def _rank(user_dense: np.ndarray, item_dense: np.ndarray) -> np.ndarray:
        logits = item_dense.sum(axis=1) + 0.01 * float(user_dense.sum())
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
