"""FeatureService over gRPC: validate, decode, call ``FeatureCore``, encode. No feature logic here."""

from __future__ import annotations

from pathlib import Path
from time import perf_counter_ns
from typing import Protocol

import numpy as np
from grpc import aio

from recpipe import codec
from recpipe.config import MAX_NUM_CANDIDATES
from recpipe.errors import BadRequest
from recpipe.serving.stage import CoreStage, StageInfo, check_deadline, elapsed_us
from recpipe.types import ItemFeatures, UserFeatures
from recpipe.v1 import features_pb2, features_pb2_grpc

SERVICE_NAME = features_pb2.DESCRIPTOR.services_by_name["FeatureService"].full_name


class FeatureCoreLike(Protocol):
    """What the servicer needs of ``recpipe.features.core.FeatureCore``."""

    num_users: int
    num_items: int
    model_version: str

    def augment_user(self, user_id: int) -> UserFeatures: ...
    def augment_items(self, user_id: int, item_ids: np.ndarray) -> ItemFeatures: ...


class FeatureStage(CoreStage[FeatureCoreLike]):
    """The feature stage: ``load`` builds the core from ``loader`` off the event loop."""

    name = "features"
    service_names = (SERVICE_NAME,)
    thread_pool = "polars"

    def add_to_server(self, server: aio.Server) -> None:
        features_pb2_grpc.add_FeatureServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    def info(self) -> StageInfo:
        core = self._core
        if core is None:
            return StageInfo(self.name, threads=self._threads, details={"state": "loading"})
        return StageInfo(
            self.name,
            device="cpu",
            model_version=core.model_version,
            threads=self._threads,
            details={"num_users": str(core.num_users), "num_items": str(core.num_items)},
        )

    async def AugmentUser(
        self, request: features_pb2.AugmentUserRequest, context: aio.ServicerContext
    ) -> features_pb2.AugmentUserResponse:
        start = perf_counter_ns()
        check_deadline(context, self.name)
        core = self._ready()
        user = await self._run(core.augment_user, int(request.user_id))
        return features_pb2.AugmentUserResponse(
            user_id=user.user_id,
            dense=codec.encode(user.dense),
            sparse=codec.encode(user.sparse),
            recent_items=codec.encode(user.recent_items),
            server_us=elapsed_us(start),
        )

    async def AugmentItems(
        self, request: features_pb2.AugmentItemsRequest, context: aio.ServicerContext
    ) -> features_pb2.AugmentItemsResponse:
        start = perf_counter_ns()
        check_deadline(context, self.name)
        core = self._ready()
        item_ids = codec.decode(request.item_ids, "item_ids", "int64", (None,))
        if not 0 < item_ids.shape[0] <= MAX_NUM_CANDIDATES:
            raise BadRequest(f"item_ids: expected 1..{MAX_NUM_CANDIDATES} ids, got {item_ids.shape[0]}")
        items = await self._run(core.augment_items, int(request.user_id), item_ids)
        return features_pb2.AugmentItemsResponse(
            dense=codec.encode(items.dense), sparse=codec.encode(items.sparse), server_us=elapsed_us(start)
        )


def load_stage(models_dir: Path, data_dir: Path, *, threads: int | None = None, workers: int = 0) -> FeatureStage:
    """The feature stage over the real ``FeatureCore`` (imported here: it pulls in Polars)."""

    def loader() -> FeatureCoreLike:
        from recpipe.features.core import FeatureCore

        return FeatureCore.load(models_dir, data_dir, threads=threads)

    return FeatureStage(loader, workers=workers, threads=threads or 0)
