"""Stage clients over gRPC for the chain: encode, call with the time left, decode, translate errors.

A failed call comes back as the domain error its status code stands for (``recpipe.serving.status``),
with the stage named in the message, so the gateway's interceptor answers the client with the same
code: a stage that is down becomes UNAVAILABLE "retrieval unavailable at 127.0.0.1:50053: ...".
Each client opens its own channel to ``target``, or uses the ``channel`` it is given (the query
generator passes channels it has already checked are ready).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import numpy as np
from grpc import aio

from recpipe.errors import ArtifactMismatch, RecpipeError
from recpipe.serving import codec
from recpipe.serving.channels import make_channel
from recpipe.serving.status import error_for
from recpipe.types import StageResult
from recpipe.v1 import (
    features_pb2,
    features_pb2_grpc,
    ranking_pb2,
    ranking_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)

R = TypeVar("R")


class _StageClient:
    """What every stage client shares: its channel, calling with a deadline, errors, closing."""

    def __init__(self, stage: str, target: str, channel: aio.Channel | None = None) -> None:
        self.stage = stage
        self.target = target
        self._channel = channel if channel is not None else make_channel(target)

    @property
    def channel(self) -> aio.Channel:
        """The channel the chain calls the stage on (the gateway's readiness checks use it too)."""
        return self._channel

    async def _call(self, rpc: Callable[..., Awaitable[R]], request: object, timeout: float | None) -> R:
        try:
            return await rpc(request, timeout=timeout)
        except aio.AioRpcError as e:
            raise self._error(e) from None

    def _error(self, e: aio.AioRpcError) -> RecpipeError:
        code = e.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            return error_for(code, f"{self.stage} unavailable at {self.target}: {e.details()}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return error_for(code, f"deadline exceeded in {self.stage} ({self.target})")
        # INVALID_ARGUMENT / NOT_FOUND carry the stage's own message, which names the field or user.
        return error_for(code, f"{self.stage}: {e.details()}")

    async def close(self) -> None:
        await self._channel.close(None)


class GrpcFeatureClient(_StageClient):
    """Returns the stage's response messages as the user/items payloads (forwarded, not decoded)."""

    def __init__(self, target: str, channel: aio.Channel | None = None) -> None:
        super().__init__("features", target, channel)
        self._stub = features_pb2_grpc.FeatureServiceStub(self.channel)

    async def augment_user(self, user_id: int, timeout: float | None) -> StageResult[features_pb2.AugmentUserResponse]:
        r = await self._call(self._stub.AugmentUser, features_pb2.AugmentUserRequest(user_id=user_id), timeout)
        return _result(r, r)

    async def augment_items(
        self, user_id: int, item_ids: np.ndarray, timeout: float | None
    ) -> StageResult[features_pb2.AugmentItemsResponse]:
        request = features_pb2.AugmentItemsRequest(user_id=user_id, item_ids=codec.encode(item_ids))
        r = await self._call(self._stub.AugmentItems, request, timeout)
        return _result(r, r)


class GrpcRetrievalClient(_StageClient):
    def __init__(self, target: str, channel: aio.Channel | None = None) -> None:
        super().__init__("retrieval", target, channel)
        self._stub = retrieval_pb2_grpc.RetrievalServiceStub(self.channel)

    async def retrieve(
        self, user: features_pb2.AugmentUserResponse, k: int, timeout: float | None
    ) -> StageResult[np.ndarray]:
        request = retrieval_pb2.RetrieveRequest(user_dense=user.dense, user_sparse=user.sparse, k=k)
        r = await self._call(self._stub.Retrieve, request, timeout)
        return _result(_decode(r.item_ids, "retrieval", "item_ids", "int64", (None,)), r, r.model_version)


class GrpcRankingClient(_StageClient):
    def __init__(self, target: str, channel: aio.Channel | None = None) -> None:
        super().__init__("ranking", target, channel)
        self._stub = ranking_pb2_grpc.RankingServiceStub(self.channel)

    async def rank(
        self, user: features_pb2.AugmentUserResponse, items: features_pb2.AugmentItemsResponse, timeout: float | None
    ) -> StageResult[np.ndarray]:
        request = ranking_pb2.RankRequest(
            user_dense=user.dense, user_sparse=user.sparse, item_dense=items.dense, item_sparse=items.sparse
        )
        r = await self._call(self._stub.Rank, request, timeout)
        k = items.dense.shape[0] if items.dense.shape else None
        return _result(_decode(r.scores, "ranking", "scores", "float32", (k,)), r, r.model_version)


def _result(value: R, reply: Any, model_version: str = "") -> StageResult[R]:
    """``value`` with the timing fields every stage reply carries."""
    return StageResult(value, reply.server_us, model_version, reply.queue_us, reply.compute_us, reply.batch_size)


def _decode(tensor: object, stage: str, field: str, dtype: str, shape: tuple[int | None, ...]) -> np.ndarray:
    """Decode a stage's answer; a malformed one is the stage's fault, not the caller's."""
    try:
        return codec.decode(tensor, field, dtype, shape)  # type: ignore[arg-type]
    except RecpipeError as e:
        raise ArtifactMismatch(f"{stage} answered a malformed tensor: {e}") from None
