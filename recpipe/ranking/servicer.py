"""RankingService over gRPC: the codec and contract of Rank; ``CoreStage.handle`` runs the request.

Concurrent Rank calls share one DLRM forward over all their candidates (the stage's batcher).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import numpy as np
from grpc import aio

from recpipe import schema
from recpipe.finite import check_finite
from recpipe.ranking import NAME
from recpipe.ranking.contract import RankingLimits, RankQuery
from recpipe.serving import codec
from recpipe.serving.stage import CoreStage, Method
from recpipe.v1 import ranking_pb2, ranking_pb2_grpc

SERVICE_NAME = ranking_pb2.DESCRIPTOR.services_by_name["RankingService"].full_name
USER_SPARSE_DIM = len(schema.USER_CATEGORICAL)
ITEM_SPARSE_DIM = len(schema.ITEM_CATEGORICAL)


class RankingCoreLike(Protocol):
    """What the servicer needs of ``recpipe.ranking.core.RankingCore``."""

    device: str
    model_version: str
    user_dense_dim: int
    item_dense_dim: int

    @property
    def limits(self) -> RankingLimits: ...
    def rank_batch(self, queries: Sequence[RankQuery]) -> list[np.ndarray]: ...


def _decode(core: RankingCoreLike, request: ranking_pb2.RankRequest) -> RankQuery:
    item_dense = codec.decode(request.item_dense, "item_dense", "float32", (None, core.item_dense_dim))
    return RankQuery.checked(
        codec.decode(request.user_dense, "user_dense", "float32", (core.user_dense_dim,)),
        codec.decode_ids(request.user_sparse, "user_sparse", (USER_SPARSE_DIM,)),
        item_dense,
        codec.decode_ids(request.item_sparse, "item_sparse", (item_dense.shape[0], ITEM_SPARSE_DIM)),
        core.limits,
    )


def _encode(core: RankingCoreLike, scores: np.ndarray) -> ranking_pb2.RankResponse:
    return ranking_pb2.RankResponse(scores=codec.encode(check_finite(scores, "rank")), model_version=core.model_version)


RANK: Method[RankingCoreLike, RankQuery, np.ndarray] = Method(
    "Rank", "rank", _decode, _encode, batch=lambda core: core.rank_batch, rows=lambda query: query.k)


class RankingStage(CoreStage[RankingCoreLike]):
    name = NAME
    service_names = (SERVICE_NAME,)
    methods = (RANK,)

    def add_to_server(self, server: aio.Server) -> None:
        ranking_pb2_grpc.add_RankingServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    def describe(self, core: RankingCoreLike) -> dict[str, str]:
        return {"user_dense_dim": str(core.user_dense_dim), "item_dense_dim": str(core.item_dense_dim),
                **getattr(core, "details", {})}

    async def Rank(self, request: ranking_pb2.RankRequest, context: aio.ServicerContext) -> ranking_pb2.RankResponse:
        return await self.handle(RANK, request, context)

    async def RankBatch(self, request: ranking_pb2.RankBatchRequest,
                        context: aio.ServicerContext) -> ranking_pb2.RankBatchResponse:
        return ranking_pb2.RankBatchResponse(entries=await self.handle_batch(RANK, request, context, ranking_pb2.RankEntry))

    async def RankStream(self, requests: AsyncIterator[ranking_pb2.RankBatchRequest], context: aio.ServicerContext) -> None:
        await self.handle_stream(RANK, requests, context, ranking_pb2.RankEntry, ranking_pb2.RankBatchResponse)
