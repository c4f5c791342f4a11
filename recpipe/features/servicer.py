"""FeatureService over gRPC: the codecs and contracts of AugmentUser and AugmentItems; ``CoreStage.handle``
runs the requests. No feature logic.

AugmentItems goes through the stage's dynamic batcher (one gather for every queued request);
AugmentUser is a single-row gather of tens of microseconds, so it runs directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from grpc import aio

from recpipe.features import NAME
from recpipe.features.contract import FeatureLimits, ItemsQuery, UserQuery
from recpipe.serving import codec
from recpipe.serving.stage import CoreStage, Method
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


def _id_limit(core: FeatureCoreLike) -> int:
    """A bound on every encoded categorical id: a table's vocabulary never exceeds its rows."""
    return max(core.num_users, core.num_items)


def _encode_user(core: FeatureCoreLike, user: UserFeatures) -> features_pb2.AugmentUserResponse:
    return features_pb2.AugmentUserResponse(user_id=user.user_id, dense=codec.encode(user.dense),
                                            sparse=codec.encode_ids(user.sparse, _id_limit(core)),
                                            recent_items=codec.encode(user.recent_items))


def _decode_items(core: FeatureCoreLike, request: features_pb2.AugmentItemsRequest) -> ItemsQuery:
    item_ids = codec.decode(request.item_ids, "item_ids", "int64", (None,))
    return ItemsQuery.checked(int(request.user_id), item_ids, core.limits)


def _encode_items(core: FeatureCoreLike, items: ItemFeatures) -> features_pb2.AugmentItemsResponse:
    # the ids as int32 (they fit): the largest tensor of the chain's largest messages, halved
    return features_pb2.AugmentItemsResponse(dense=codec.encode(items.dense),
                                             sparse=codec.encode_ids(items.sparse, _id_limit(core)))


AUGMENT_USER: Method[FeatureCoreLike, UserQuery, UserFeatures] = Method(
    "AugmentUser", "augment_user", lambda core, request: UserQuery.checked(int(request.user_id), core.limits),
    _encode_user, single=lambda core: core.user_features)
AUGMENT_ITEMS: Method[FeatureCoreLike, ItemsQuery, ItemFeatures] = Method(
    "AugmentItems", "augment_items", _decode_items, _encode_items, batch=lambda core: core.items_batch,
    rows=lambda query: int(query.item_ids.shape[0]))


class FeatureStage(CoreStage[FeatureCoreLike]):
    name = NAME
    service_names = (SERVICE_NAME,)
    thread_pools = ("polars",)
    methods = (AUGMENT_USER, AUGMENT_ITEMS)

    def add_to_server(self, server: aio.Server) -> None:
        features_pb2_grpc.add_FeatureServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    def describe(self, core: FeatureCoreLike) -> dict[str, str]:
        return {"num_users": str(core.num_users), "num_items": str(core.num_items)}

    async def AugmentUser(
        self, request: features_pb2.AugmentUserRequest, context: aio.ServicerContext
    ) -> features_pb2.AugmentUserResponse:
        return await self.handle(AUGMENT_USER, request, context)

    async def AugmentItems(
        self, request: features_pb2.AugmentItemsRequest, context: aio.ServicerContext
    ) -> features_pb2.AugmentItemsResponse:
        return await self.handle(AUGMENT_ITEMS, request, context)

    async def AugmentUserBatch(
        self, request: features_pb2.AugmentUserBatchRequest, context: aio.ServicerContext
    ) -> features_pb2.AugmentUserBatchResponse:
        entries = await self.handle_batch(AUGMENT_USER, request, context, features_pb2.AugmentUserEntry)
        return features_pb2.AugmentUserBatchResponse(entries=entries)

    async def AugmentItemsBatch(
        self, request: features_pb2.AugmentItemsBatchRequest, context: aio.ServicerContext
    ) -> features_pb2.AugmentItemsBatchResponse:
        entries = await self.handle_batch(AUGMENT_ITEMS, request, context, features_pb2.AugmentItemsEntry)
        return features_pb2.AugmentItemsBatchResponse(entries=entries)

    async def AugmentUserStream(self, requests: AsyncIterator[features_pb2.AugmentUserBatchRequest],
                                context: aio.ServicerContext) -> None:
        await self.handle_stream(AUGMENT_USER, requests, context, features_pb2.AugmentUserEntry,
                                 features_pb2.AugmentUserBatchResponse)

    async def AugmentItemsStream(self, requests: AsyncIterator[features_pb2.AugmentItemsBatchRequest],
                                 context: aio.ServicerContext) -> None:
        await self.handle_stream(AUGMENT_ITEMS, requests, context, features_pb2.AugmentItemsEntry,
                                 features_pb2.AugmentItemsBatchResponse)
