"""RetrievalService over gRPC: validate, decode, call ``RetrievalCore``, encode. No search logic here."""

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
from recpipe.types import Candidates, UserFeatures
from recpipe.v1 import retrieval_pb2, retrieval_pb2_grpc

SERVICE_NAME = retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"].full_name
USER_SPARSE_DIM = len(schema.USER_CATEGORICAL)
#: Per-request ceilings on the search effort a caller may ask for (0 = the index's tuned default).
MAX_NPROBE = 4096
MAX_EF_SEARCH = 16384


class RetrievalCoreLike(Protocol):
    """What the servicer needs of ``recpipe.retrieval.core.RetrievalCore``."""

    device: str
    model_version: str
    num_items: int
    user_dense_dim: int
    history_len: int
    details: dict[str, str]

    def retrieve(self, user: UserFeatures, k: int, nprobe: int = 0, ef_search: int = 0) -> Candidates: ...


class RetrievalStage(CoreStage[RetrievalCoreLike]):
    name = "retrieval"
    service_names = (SERVICE_NAME,)

    def add_to_server(self, server: aio.Server) -> None:
        retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    def info(self) -> StageInfo:
        core = self._core
        if core is None:
            return StageInfo(self.name, threads=self._threads, details={"state": "loading"})
        details = {**core.details, "num_items": str(core.num_items)}
        return StageInfo(self.name, core.device, core.model_version, self._threads, details)

    async def Retrieve(
        self, request: retrieval_pb2.RetrieveRequest, context: aio.ServicerContext
    ) -> retrieval_pb2.RetrieveResponse:
        start = perf_counter_ns()
        check_deadline(context, self.name)
        core = self._ready()
        limit = min(MAX_NUM_CANDIDATES, core.num_items)
        if not 0 < request.k <= limit:
            raise BadRequest(f"k: expected 1..{limit}, got {request.k}")
        if not 0 <= request.nprobe <= MAX_NPROBE:
            raise BadRequest(f"nprobe: expected 0..{MAX_NPROBE}, got {request.nprobe}")
        if not 0 <= request.ef_search <= MAX_EF_SEARCH:
            raise BadRequest(f"ef_search: expected 0..{MAX_EF_SEARCH}, got {request.ef_search}")
        dense = codec.decode(request.user_dense, "user_dense", "float32", (core.user_dense_dim,))
        sparse = codec.decode(request.user_sparse, "user_sparse", "int64", (USER_SPARSE_DIM,))
        if request.HasField("recent_items"):
            recent = codec.decode(request.recent_items, "recent_items", "int64", (core.history_len,))
        else:
            recent = np.full(core.history_len, -1, dtype=np.int64)
        user = UserFeatures(user_id=-1, dense=dense, sparse=sparse, recent_items=recent)
        found = await self._run(core.retrieve, user, int(request.k), int(request.nprobe), int(request.ef_search))
        return retrieval_pb2.RetrieveResponse(
            item_ids=codec.encode(found.item_ids),
            scores=codec.encode(found.scores),
            server_us=elapsed_us(start),
            model_version=core.model_version,
        )


def load_stage(models_dir: Path, *, device: str = "auto", threads: int = 0, workers: int = 0) -> RetrievalStage:
    """The retrieval stage over the real ``RetrievalCore`` (imported here: it pulls in torch and FAISS)."""

    # Decoded tensors are read-only views over the request bytes; the core only reads them, so torch's
    # warning about wrapping a non-writable array (once per process, at the first request) is noise.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

    def loader() -> RetrievalCoreLike:
        from recpipe.retrieval.core import RetrievalCore

        return RetrievalCore.load(models_dir, device=device)

    return RetrievalStage(loader, workers=workers, threads=threads)
