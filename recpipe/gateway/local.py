"""Stage clients that call the cores in process (no gRPC): the baseline ``recpipe bench chain`` measures
the gRPC chain against. ``server_us`` is the core call's own time."""

from __future__ import annotations

import time

import numpy as np

from recpipe.features.servicer import FeatureCoreLike
from recpipe.gateway.chain import StageResult
from recpipe.ranking.servicer import RankingCoreLike
from recpipe.retrieval.servicer import RetrievalCoreLike
from recpipe.types import ItemFeatures, UserFeatures


def _us(start: int) -> int:
    return (time.perf_counter_ns() - start) // 1000


class LocalFeatureClient:
    def __init__(self, core: FeatureCoreLike) -> None:
        self.core = core

    async def augment_user(self, user_id: int, timeout: float | None) -> StageResult[UserFeatures]:
        start = time.perf_counter_ns()
        user = self.core.augment_user(user_id)
        return StageResult(user, _us(start))

    async def augment_items(
        self, user_id: int, item_ids: np.ndarray, timeout: float | None
    ) -> StageResult[ItemFeatures]:
        start = time.perf_counter_ns()
        items = self.core.augment_items(user_id, item_ids)
        return StageResult(items, _us(start))


class LocalRetrievalClient:
    def __init__(self, core: RetrievalCoreLike) -> None:
        self.core = core

    async def num_items(self, timeout: float | None) -> int:
        return int(self.core.num_items)

    async def retrieve(self, user: UserFeatures, k: int, timeout: float | None) -> StageResult[np.ndarray]:
        start = time.perf_counter_ns()
        found = self.core.retrieve(user, k)
        return StageResult(found.item_ids, _us(start), self.core.model_version)


class LocalRankingClient:
    def __init__(self, core: RankingCoreLike) -> None:
        self.core = core

    async def rank(self, user: UserFeatures, items: ItemFeatures, timeout: float | None) -> StageResult[np.ndarray]:
        start = time.perf_counter_ns()
        scores = self.core.rank(user, items)
        return StageResult(scores, _us(start), self.core.model_version)
