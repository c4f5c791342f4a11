"""RetrievalService over gRPC: the codec and contract of Retrieve; ``CoreStage.handle`` runs the request.

Concurrent Retrieve calls share one user-tower forward and one index search (the stage's batcher). The
request's ``recent_items`` is ignored: the two-tower model does not use the user's history.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from grpc import aio

from recpipe import schema
from recpipe.finite import check_finite
from recpipe.retrieval import NAME
from recpipe.retrieval.contract import RetrievalLimits, RetrieveQuery
from recpipe.serving import codec
from recpipe.serving.stage import CoreStage, Method
from recpipe.types import Candidates
from recpipe.v1 import retrieval_pb2, retrieval_pb2_grpc

SERVICE_NAME = retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"].full_name
USER_SPARSE_DIM = len(schema.USER_CATEGORICAL)


class RetrievalCoreLike(Protocol):
    """What the servicer needs of ``recpipe.retrieval.core.RetrievalCore``."""

    device: str
    model_version: str
    num_items: int
    user_dense_dim: int

    @property
    def details(self) -> dict[str, str]: ...
    @property
    def limits(self) -> RetrievalLimits: ...
    def retrieve_batch(self, queries: Sequence[RetrieveQuery]) -> list[Candidates]: ...


def _decode(core: RetrievalCoreLike, request: retrieval_pb2.RetrieveRequest) -> RetrieveQuery:
    return RetrieveQuery.checked(
        codec.decode(request.user_dense, "user_dense", "float32", (core.user_dense_dim,)),
        codec.decode_ids(request.user_sparse, "user_sparse", (USER_SPARSE_DIM,)),
        int(request.k), core.limits, int(request.nprobe), int(request.ef_search),
    )


def _encode(core: RetrievalCoreLike, found: Candidates) -> retrieval_pb2.RetrieveResponse:
    return retrieval_pb2.RetrieveResponse(item_ids=codec.encode(found.item_ids),
                                          scores=codec.encode(check_finite(found.scores, "retrieve")),
                                          model_version=core.model_version)


RETRIEVE: Method[RetrievalCoreLike, RetrieveQuery, Candidates] = Method(
    "Retrieve", "retrieve", _decode, _encode, batch=lambda core: core.retrieve_batch)


class RetrievalStage(CoreStage[RetrievalCoreLike]):
    name = NAME
    service_names = (SERVICE_NAME,)
    thread_pools = ("torch", "faiss")  # torch where the core runs it, else FAISS's OpenMP (the CPU path)
    methods = (RETRIEVE,)

    def add_to_server(self, server: aio.Server) -> None:
        retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    def describe(self, core: RetrievalCoreLike) -> dict[str, str]:
        return {**core.details, "num_items": str(core.num_items)}

    async def Retrieve(
        self, request: retrieval_pb2.RetrieveRequest, context: aio.ServicerContext
    ) -> retrieval_pb2.RetrieveResponse:
        return await self.handle(RETRIEVE, request, context)

    async def RetrieveBatch(
        self, request: retrieval_pb2.RetrieveBatchRequest, context: aio.ServicerContext
    ) -> retrieval_pb2.RetrieveBatchResponse:
        entries = await self.handle_batch(RETRIEVE, request, context, retrieval_pb2.RetrieveEntry)
        return retrieval_pb2.RetrieveBatchResponse(entries=entries)

    async def RetrieveStream(self, requests: AsyncIterator[retrieval_pb2.RetrieveBatchRequest],
                             context: aio.ServicerContext) -> None:
        await self.handle_stream(RETRIEVE, requests, context, retrieval_pb2.RetrieveEntry,
                                 retrieval_pb2.RetrieveBatchResponse)
