"""FeatureService over gRPC: decode, check (``contract``), call ``FeatureCore``, encode. No feature logic.

AugmentItems goes through the stage's dynamic batcher (one gather for every queued request);
AugmentUser is a single-row gather of tens of microseconds, so it runs directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from time import perf_counter_ns
from typing import Protocol

from grpc import aio

from recpipe import codec
from recpipe.features.contract import FeatureLimits, ItemsQuery, UserQuery
from recpipe.serving import nvtx
from recpipe.serving.batcher import BatchConfig, Batcher
from recpipe.serving.stage import CoreStage, StageInfo, check_deadline, elapsed_us
from recpipe.types import ItemFeatures, UserFeatures
from recpipe.v1 import features_pb2, features_pb2_grpc

SERVICE_NAME = features_pb2.DESCRIPTOR.services_by_name["FeatureService"].full_name


class FeatureCoreLike(Protocol):
    """What the servicer needs of ``recpipe.features.core.FeatureCore``."""

    num_users: int
    num_items: int
    model_version: str

    @property
    def limits(self) -> FeatureLimits: ...
    def user_features(self, query: UserQuery) -> UserFeatures: ...
    def items_batch(self, queries: Sequence[ItemsQuery]) -> list[ItemFeatures]: ...


class FeatureStage(CoreStage[FeatureCoreLike]):
    """The feature stage: ``load`` builds the core from ``loader`` off the event loop."""

    name = "features"
    service_names = (SERVICE_NAME,)
    thread_pool = "polars"
    _items: Batcher[ItemsQuery, ItemFeatures]

    def add_to_server(self, server: aio.Server) -> None:
        features_pb2_grpc.add_FeatureServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    def _start(self, core: FeatureCoreLike) -> None:
        self._items = self._batcher("AugmentItems", core.items_batch)

    def info(self) -> StageInfo:
        core = self._core
        if core is None:
            return StageInfo(self.name, threads=self._threads, details={"state": "loading"})
        return StageInfo(
            self.name,
            device="cpu",
            model_version=core.model_version,
            threads=self._threads,
            details={"num_users": str(core.num_users), "num_items": str(core.num_items), **self.batch_details()},
        )

    async def AugmentUser(
        self, request: features_pb2.AugmentUserRequest, context: aio.ServicerContext
    ) -> features_pb2.AugmentUserResponse:
        start = perf_counter_ns()
        check_deadline(context, self.name)
        core = self._ready()
        query = UserQuery.checked(int(request.user_id), core.limits)
        computed = perf_counter_ns()
        with nvtx.range("augment_user.compute"):
            user = await self._run(core.user_features, query)
        compute_us = elapsed_us(computed)
        return features_pb2.AugmentUserResponse(
            user_id=user.user_id,
            dense=codec.encode(user.dense),
            sparse=codec.encode(user.sparse),
            recent_items=codec.encode(user.recent_items),
            server_us=elapsed_us(start),
            compute_us=compute_us,
            batch_size=1,
        )

    async def AugmentItems(
        self, request: features_pb2.AugmentItemsRequest, context: aio.ServicerContext
    ) -> features_pb2.AugmentItemsResponse:
        start = perf_counter_ns()
        deadline = check_deadline(context, self.name)
        core = self._ready()
        with nvtx.range("augment_items.decode"):
            item_ids = codec.decode(request.item_ids, "item_ids", "int64", (None,))
            query = ItemsQuery.checked(int(request.user_id), item_ids, core.limits)
        done = await self._items.submit(query, deadline)
        with nvtx.range("augment_items.encode"):
            return features_pb2.AugmentItemsResponse(
                dense=codec.encode(done.value.dense), sparse=codec.encode(done.value.sparse),
                server_us=elapsed_us(start), queue_us=done.queue_us, compute_us=done.compute_us,
                batch_size=done.batch_size,
            )


def load_stage(
    models_dir: Path, data_dir: Path, *, threads: int | None = None, workers: int = 0, batch: BatchConfig | None = None
) -> FeatureStage:
    """The feature stage over the real ``FeatureCore`` (imported here: it pulls in Polars)."""

    def loader() -> FeatureCoreLike:
        from recpipe.features.core import FeatureCore

        return FeatureCore.load(models_dir, data_dir, threads=threads)

    return FeatureStage(loader, workers=workers, threads=threads or 0, batch=batch)
