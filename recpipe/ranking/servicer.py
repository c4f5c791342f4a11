"""RankingService over gRPC: decode, check (``contract``), batch, call ``RankingCore``, encode.

Concurrent Rank calls share one DLRM forward over all their candidates (``Batcher``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter_ns
from typing import Any, Protocol

import numpy as np
from grpc import aio

from recpipe import codec, schema
from recpipe.finite import check_finite
from recpipe.ranking.contract import RankingLimits, RankQuery
from recpipe.serving import nvtx
from recpipe.serving.batcher import BatchConfig, Batcher
from recpipe.serving.stage import CoreStage, StageInfo, check_deadline, elapsed_us
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


class RankingStage(CoreStage[RankingCoreLike]):
    name = "ranking"
    service_names = (SERVICE_NAME,)
    _rank: Batcher[RankQuery, np.ndarray]

    def add_to_server(self, server: aio.Server) -> None:
        ranking_pb2_grpc.add_RankingServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    def _start(self, core: RankingCoreLike) -> None:
        self._rank = self._batcher("Rank", core.rank_batch, core.device)

    def info(self) -> StageInfo:
        core = self._core
        if core is None:
            return StageInfo(self.name, threads=self._threads, details={"state": "loading"})
        details = {"user_dense_dim": str(core.user_dense_dim), "item_dense_dim": str(core.item_dense_dim),
                   **getattr(core, "details", {}), **self.batch_details()}
        return StageInfo(self.name, core.device, core.model_version, self._threads, details)

    async def Rank(self, request: ranking_pb2.RankRequest, context: aio.ServicerContext) -> ranking_pb2.RankResponse:
        start = perf_counter_ns()
        deadline = check_deadline(context, self.name)
        core = self._ready()
        with nvtx.range("rank.decode"):
            item_dense = codec.decode(request.item_dense, "item_dense", "float32", (None, core.item_dense_dim))
            query = RankQuery.checked(
                codec.decode(request.user_dense, "user_dense", "float32", (core.user_dense_dim,)),
                codec.decode(request.user_sparse, "user_sparse", "int64", (USER_SPARSE_DIM,)),
                item_dense,
                codec.decode(request.item_sparse, "item_sparse", "int64", (item_dense.shape[0], ITEM_SPARSE_DIM)),
                core.limits,
            )
        done = await self._rank.submit(query, deadline)
        with nvtx.range("rank.encode"):
            return ranking_pb2.RankResponse(
                scores=codec.encode(check_finite(done.value, "rank")), server_us=elapsed_us(start),
                model_version=core.model_version, queue_us=done.queue_us, compute_us=done.compute_us,
                batch_size=done.batch_size,
            )


def load_stage(
    models_dir: Path, *, device: str = "auto", threads: int = 0, workers: int = 0, batch: BatchConfig | None = None,
    **options: Any,
) -> RankingStage:
    """The ranking stage over the real ``RankingCore`` (imported here: it pulls in torch)."""

    # Decoded tensors are read-only views over the request bytes; the core only reads them, so torch's
    # warning about wrapping a non-writable array (once per process, at the first request) is noise.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

    def loader() -> RankingCoreLike:
        from recpipe.ranking.core import RankingCore

        return RankingCore.load(models_dir, device=device, **options)  # options: cuda_graphs, embeddings, precision

    return RankingStage(loader, workers=workers, threads=threads, batch=batch)
