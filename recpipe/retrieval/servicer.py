"""RetrievalService over gRPC: decode, check (``contract``), batch, call ``RetrievalCore``, encode.

Concurrent Retrieve calls share one user-tower forward and one index search (``Batcher``). The
request's ``recent_items`` is ignored: the two-tower model does not use the user's history.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter_ns
from typing import Any, Protocol

from grpc import aio

from recpipe import codec, schema
from recpipe.finite import check_finite
from recpipe.retrieval.contract import RetrievalLimits, RetrieveQuery
from recpipe.serving import nvtx
from recpipe.serving.batcher import BatchConfig, Batcher
from recpipe.serving.stage import CoreStage, StageInfo, check_deadline, elapsed_us
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
    details: dict[str, str]

    @property
    def limits(self) -> RetrievalLimits: ...
    def retrieve_batch(self, queries: Sequence[RetrieveQuery]) -> list[Candidates]: ...


class RetrievalStage(CoreStage[RetrievalCoreLike]):
    name = "retrieval"
    service_names = (SERVICE_NAME,)
    _retrieve: Batcher[RetrieveQuery, Candidates]

    def add_to_server(self, server: aio.Server) -> None:
        retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    def _start(self, core: RetrievalCoreLike) -> None:
        self._retrieve = self._batcher("Retrieve", core.retrieve_batch, core.device)

    def info(self) -> StageInfo:
        core = self._core
        if core is None:
            return StageInfo(self.name, threads=self._threads, details={"state": "loading"})
        details = {**core.details, "num_items": str(core.num_items), **self.batch_details()}
        return StageInfo(self.name, core.device, core.model_version, self._threads, details)

    async def Retrieve(
        self, request: retrieval_pb2.RetrieveRequest, context: aio.ServicerContext
    ) -> retrieval_pb2.RetrieveResponse:
        start = perf_counter_ns()
        deadline = check_deadline(context, self.name)
        core = self._ready()
        with nvtx.range("retrieve.decode"):
            query = RetrieveQuery.checked(
                codec.decode(request.user_dense, "user_dense", "float32", (core.user_dense_dim,)),
                codec.decode(request.user_sparse, "user_sparse", "int64", (USER_SPARSE_DIM,)),
                int(request.k), core.limits, int(request.nprobe), int(request.ef_search),
            )
        done = await self._retrieve.submit(query, deadline)
        with nvtx.range("retrieve.encode"):
            return retrieval_pb2.RetrieveResponse(
                item_ids=codec.encode(done.value.item_ids),
                scores=codec.encode(check_finite(done.value.scores, "retrieve")),
                server_us=elapsed_us(start),
                model_version=core.model_version,
                queue_us=done.queue_us,
                compute_us=done.compute_us,
                batch_size=done.batch_size,
            )


def load_stage(
    models_dir: Path, *, device: str = "auto", threads: int = 0, workers: int = 0, batch: BatchConfig | None = None,
    **options: Any,
) -> RetrievalStage:
    """The retrieval stage over the real ``RetrievalCore`` (imported here: it pulls in torch and FAISS)."""

    # Decoded tensors are read-only views over the request bytes; the core only reads them, so torch's
    # warning about wrapping a non-writable array (once per process, at the first request) is noise.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

    def loader() -> RetrievalCoreLike:
        from recpipe.retrieval.core import RetrievalCore

        return RetrievalCore.load(models_dir, device=device, **options)  # cuda_graphs, precision, rescore

    return RetrievalStage(loader, workers=workers, threads=threads, batch=batch)
