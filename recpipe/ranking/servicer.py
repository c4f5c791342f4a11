"""RankingService over gRPC: validate, decode, call ``RankingCore``, encode. No model logic here."""

from __future__ import annotations

import warnings
from pathlib import Path
from time import perf_counter_ns
from typing import Protocol

import numpy as np
from grpc import aio

from recpipe import codec, schema
from recpipe.config import MAX_NUM_CANDIDATES
from recpipe.errors import BadRequest
from recpipe.serving.stage import CoreStage, StageInfo, check_deadline, elapsed_us
from recpipe.types import ItemFeatures, UserFeatures
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

    def rank(self, user: UserFeatures, items: ItemFeatures) -> np.ndarray: ...


class RankingStage(CoreStage[RankingCoreLike]):
    name = "ranking"
    service_names = (SERVICE_NAME,)

    def add_to_server(self, server: aio.Server) -> None:
        ranking_pb2_grpc.add_RankingServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    def info(self) -> StageInfo:
        core = self._core
        if core is None:
            return StageInfo(self.name, threads=self._threads, details={"state": "loading"})
        details = {"user_dense_dim": str(core.user_dense_dim), "item_dense_dim": str(core.item_dense_dim)}
        return StageInfo(self.name, core.device, core.model_version, self._threads, details)

    async def Rank(self, request: ranking_pb2.RankRequest, context: aio.ServicerContext) -> ranking_pb2.RankResponse:
        start = perf_counter_ns()
        check_deadline(context, self.name)
        core = self._ready()
        user_dense = codec.decode(request.user_dense, "user_dense", "float32", (core.user_dense_dim,))
        user_sparse = codec.decode(request.user_sparse, "user_sparse", "int64", (USER_SPARSE_DIM,))
        item_dense = codec.decode(request.item_dense, "item_dense", "float32", (None, core.item_dense_dim))
        k = item_dense.shape[0]
        if not 0 < k <= MAX_NUM_CANDIDATES:
            raise BadRequest(f"item_dense: expected 1..{MAX_NUM_CANDIDATES} rows, got {k}")
        item_sparse = codec.decode(request.item_sparse, "item_sparse", "int64", (k, ITEM_SPARSE_DIM))
        user = UserFeatures(user_id=-1, dense=user_dense, sparse=user_sparse, recent_items=_NO_HISTORY)
        items = ItemFeatures(item_ids=np.full(k, -1, dtype=np.int64), dense=item_dense, sparse=item_sparse)
        scores = await self._run(core.rank, user, items)
        return ranking_pb2.RankResponse(
            scores=codec.encode(scores), server_us=elapsed_us(start), model_version=core.model_version
        )


_NO_HISTORY = np.empty(0, dtype=np.int64)


def load_stage(models_dir: Path, *, device: str = "auto", threads: int = 0, workers: int = 0) -> RankingStage:
    """The ranking stage over the real ``RankingCore`` (imported here: it pulls in torch)."""

    # Decoded tensors are read-only views over the request bytes; the core only reads them, so torch's
    # warning about wrapping a non-writable array (once per process, at the first request) is noise.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

    def loader() -> RankingCoreLike:
        from recpipe.ranking.core import RankingCore

        return RankingCore.load(models_dir, device=device)

    return RankingStage(loader, workers=workers, threads=threads)
