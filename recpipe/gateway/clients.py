"""Stage clients over gRPC for the chain: encode, call with the time left, decode, translate errors.

A failed call comes back as the domain error its status code stands for (``recpipe.serving.status``),
with the stage named in the message, so the gateway's interceptor answers the client with the same
code: a stage that is down becomes UNAVAILABLE "retrieval unavailable at 127.0.0.1:50053: ...".
Each client opens its own channel to ``target``, or uses the ``channel`` it is given (the query
generator passes channels it has already checked are ready). With ``hops`` (``recpipe.gateway.hops``)
the calls in flight go out as one batch call per stage method (with ``HopConfig.stream``, as one
message of a stream per stage method and replica: ``recpipe.gateway.streams``); where ``target`` lists several replicas
(``recpipe serve --replicas``), the client also opens one channel per replica, and the hop chooses
the replica of each batch itself (the balanced channel stays for the calls while no replica's own
channel is up).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import numpy as np
from grpc import aio

from recpipe.errors import ArtifactMismatch, RecpipeError
from recpipe.gateway.hops import Hop, HopConfig, Route, replica_targets, timeout_us
from recpipe.gateway.streams import HopStream, StreamBroken
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
#: a status code from its number (an entry error carries the number)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _StageClient:
    """What every stage client shares: its channel, calling with a deadline, errors, batched hops,
    closing."""

    def __init__(self, stage: str, target: str, channel: aio.Channel | None = None,
                 hops: HopConfig | None = None) -> None:
        self.stage = stage
        self.target = target
        self._channel = channel if channel is not None else make_channel(target)
        self._hop_config = hops or HopConfig(max_batch=1)
        self.hops: dict[str, Hop[Any, Any]] = {}
        replicas = replica_targets(target) if channel is None else [target]
        #: the channel of each replica, in the order the hops prefer them (one: the balanced channel)
        self.replica_channels = [self._channel] if len(replicas) == 1 else [make_channel(t) for t in replicas]
        if len(self.replica_channels) > 1:
            for replica in self.replica_channels:
                replica.get_state(try_to_connect=True)  # connected before the first call needs it
        #: the batch calls out on each replica from all of this stage's hops (``Hop``'s ``busy``)
        self._replica_busy = [0] * len(self.replica_channels)
        #: per replica, False while the gateway's health checks say to pass it over (frozen, draining:
        #: ``recpipe.gateway.readiness``); its hops send there only while it is True and connected
        self.replica_ok = [True] * len(self.replica_channels)
        #: the hops' streams, one per method and replica (``HopConfig.stream``)
        self.streams: list[HopStream] = []

    @property
    def channel(self) -> aio.Channel:
        """The channel the chain calls the stage on, balanced over its replicas (a replica's own channel, in
        ``replica_channels``, is what its hops send on and the gateway's readiness checks ask)."""
        return self._channel

    def _hop(self, stub_class: Callable[[aio.Channel], Any], method: str, batch_request: Callable[..., Any],
             rows: Callable[[Any], int] | None = None) -> Hop[Any, Any]:
        """The calls of ``method`` through a ``Hop``: one ``<method>Batch`` RPC (entries in
        ``batch_request``) for the calls in flight, ``method`` for a call alone, on each replica; with
        ``HopConfig.stream``, each batch (a lone call too) as one message of ``<method>Stream``.
        ``rows(request)``: the call's rows in a batch message (``recpipe.config.MAX_BATCH_ROWS``)."""
        several = len(self.replica_channels) > 1
        # a ``dns:`` name keeps one RPC per call, so round_robin spreads every call over the addresses it
        # resolves to (a stream would pin its calls to one of them); the addresses ``serve --replicas``
        # lists each have their own route, and a host:port is one server
        stream = self._hop_config.stream and not self.target.startswith("dns:")
        routes = [self._route(stub_class(ch), method, batch_request, ch if several else None, stream, i)
                  for i, ch in enumerate(self.replica_channels)]
        # while no replica's own channel is connected (at start, or after a restart), the balanced
        # channel carries the calls
        fallback = self._route(stub_class(self._channel), method, batch_request, None) if several else None
        hop: Hop[Any, Any] = Hop(f"{self.stage}.{method}", routes, self._hop_config, fallback, self._replica_busy, rows)
        self.hops[method] = hop
        return hop

    def _route(self, stub: Any, method: str, batch_request: Callable[..., Any], channel: aio.Channel | None,
               stream: bool = False, replica: int = 0) -> Route:
        """The unary and batch calls of ``method`` on ``stub``; with ``stream``, both as messages of one
        ``<method>Stream`` (``recpipe.gateway.streams``), back to the RPCs if the stage has none. With
        ``channel`` (one replica's), the route is up while ``replica_ok[replica]`` and it is connected."""
        unary, batch = getattr(stub, method), getattr(stub, f"{method}Batch")

        async def one(request: Any, timeout: float | None) -> Any:
            return await self._call(unary, request, timeout)

        async def many(requests: list[Any], timeouts_us: list[int], timeout: float | None) -> list[Any]:
            reply = await self._call(batch, batch_request(entries=requests, timeout_us=timeouts_us), timeout)
            return self._entries(reply)

        ok = self.replica_ok
        up = (lambda: True) if channel is None else (lambda: ok[replica] and _connected(channel))
        if not stream:
            return Route(one, many, up)
        hop_stream = HopStream(f"{self.stage}.{method}", getattr(stub, f"{method}Stream"))
        self.streams.append(hop_stream)

        async def streamed(requests: list[Any], timeouts_us: list[int], timeout: float | None) -> list[Any]:
            if hop_stream.unsupported:
                return await many(requests, timeouts_us, timeout)
            try:
                reply = await hop_stream(batch_request(entries=requests, timeout_us=timeouts_us), timeout)
            except StreamBroken as e:
                if e.code == grpc.StatusCode.UNIMPLEMENTED:
                    return await many(requests, timeouts_us, timeout)
                raise self._failure(e.code, e.details) from None
            except TimeoutError:
                raise self._failure(grpc.StatusCode.DEADLINE_EXCEEDED, "") from None
            return self._entries(reply)

        async def streamed_one(request: Any, timeout: float | None) -> Any:
            answer = (await streamed([request], [timeout_us(timeout)], timeout))[0]
            if isinstance(answer, BaseException):
                raise answer
            return answer

        return Route(streamed_one, streamed, up)

    def _entries(self, reply: Any) -> list[Any]:
        """A batch answer's entries: each its response, or the domain error of its status."""
        return [e.ok if e.WhichOneof("result") == "ok" else self._failure(_CODES.get(e.error.code, grpc.StatusCode.UNKNOWN),
                                                                          e.error.message)
                for e in reply.entries]

    async def _call(self, rpc: Callable[..., Awaitable[R]], request: object, timeout: float | None) -> R:
        try:
            return await rpc(request, timeout=timeout)
        except aio.AioRpcError as e:
            raise self._failure(e.code(), e.details() or "") from None

    def _failure(self, code: grpc.StatusCode, details: str) -> RecpipeError:
        """The domain error a stage's status stands for, naming the stage. CANCELLED from a stage is the
        stage going away, not the gateway's caller cancelling (that ends the gateway's own task): gRPC
        cancels the calls a stopping server had not yet taken up (grpc/grpc#10418)."""
        if code == grpc.StatusCode.CANCELLED:
            code, details = grpc.StatusCode.UNAVAILABLE, f"it cancelled the call as it stopped (CANCELLED: {details})"
        if code == grpc.StatusCode.UNAVAILABLE:
            return error_for(code, f"{self.stage} unavailable at {self.target}: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return error_for(code, f"deadline exceeded in {self.stage} ({self.target})")
        # INVALID_ARGUMENT / NOT_FOUND carry the stage's own message, which names the field or user.
        return error_for(code, f"{self.stage}: {details}")

    async def close(self) -> None:
        for hop in self.hops.values():
            await hop.close()
        for stream in self.streams:
            await stream.close()
        for channel in {id(c): c for c in (self._channel, *self.replica_channels)}.values():
            await channel.close(None)


class GrpcFeatureClient(_StageClient):
    """Returns the stage's response messages as the user/items payloads (forwarded, not decoded)."""

    def __init__(self, target: str, channel: aio.Channel | None = None, hops: HopConfig | None = None) -> None:
        super().__init__("features", target, channel, hops)
        stub = features_pb2_grpc.FeatureServiceStub
        self._user = self._hop(stub, "AugmentUser", features_pb2.AugmentUserBatchRequest)
        self._items = self._hop(stub, "AugmentItems", features_pb2.AugmentItemsBatchRequest, _rows("item_ids"))

    async def augment_user(self, user_id: int, timeout: float | None) -> StageResult[features_pb2.AugmentUserResponse]:
        r = await self._user(features_pb2.AugmentUserRequest(user_id=user_id), timeout)
        return _result(r, r)

    async def augment_items(
        self, user_id: int, item_ids: np.ndarray, timeout: float | None
    ) -> StageResult[features_pb2.AugmentItemsResponse]:
        r = await self._items(features_pb2.AugmentItemsRequest(user_id=user_id, item_ids=codec.encode(item_ids)), timeout)
        return _result(r, r)


class GrpcRetrievalClient(_StageClient):
    def __init__(self, target: str, channel: aio.Channel | None = None, hops: HopConfig | None = None) -> None:
        super().__init__("retrieval", target, channel, hops)
        self._retrieve = self._hop(retrieval_pb2_grpc.RetrievalServiceStub, "Retrieve", retrieval_pb2.RetrieveBatchRequest)

    async def retrieve(
        self, user: features_pb2.AugmentUserResponse, k: int, timeout: float | None
    ) -> StageResult[np.ndarray]:
        request = retrieval_pb2.RetrieveRequest(user_dense=user.dense, user_sparse=user.sparse, k=k)
        r = await self._retrieve(request, timeout)
        return _result(_decode(r.item_ids, "retrieval", "item_ids", "int64", (None,)), r, r.model_version)


class GrpcRankingClient(_StageClient):
    def __init__(self, target: str, channel: aio.Channel | None = None, hops: HopConfig | None = None) -> None:
        super().__init__("ranking", target, channel, hops)
        self._rank = self._hop(ranking_pb2_grpc.RankingServiceStub, "Rank", ranking_pb2.RankBatchRequest,
                               _rows("item_dense"))

    async def rank(
        self, user: features_pb2.AugmentUserResponse, items: features_pb2.AugmentItemsResponse, timeout: float | None
    ) -> StageResult[np.ndarray]:
        request = ranking_pb2.RankRequest(
            user_dense=user.dense, user_sparse=user.sparse, item_dense=items.dense, item_sparse=items.sparse
        )
        r = await self._rank(request, timeout)
        k = items.dense.shape[0] if items.dense.shape else None
        return _result(_decode(r.scores, "ranking", "scores", "float32", (k,)), r, r.model_version)


def _rows(field: str) -> Callable[[Any], int]:
    """A hop's ``rows``: the first dimension of the request's tensor ``field`` (its candidates or ids)."""

    def rows(request: Any) -> int:
        shape = getattr(request, field).shape
        return int(shape[0]) if shape else 1

    return rows


def _connected(channel: aio.Channel) -> bool:
    """Whether a replica's channel is connected; an idle one (its replica went away, or the channel sat
    unused) is asked to connect and counts as down until it has."""
    state = channel.get_state()
    if state == grpc.ChannelConnectivity.IDLE:
        channel.get_state(try_to_connect=True)
    return state == grpc.ChannelConnectivity.READY


def _result(value: R, reply: Any, model_version: str = "") -> StageResult[R]:
    """``value`` with the timing fields every stage reply carries."""
    return StageResult(value, reply.server_us, model_version, reply.queue_us, reply.compute_us, reply.batch_size)


def _decode(tensor: object, stage: str, field: str, dtype: str, shape: tuple[int | None, ...]) -> np.ndarray:
    """Decode a stage's answer; a malformed one is the stage's fault, not the caller's."""
    try:
        return codec.decode(tensor, field, dtype, shape)  # type: ignore[arg-type]
    except RecpipeError as e:
        raise ArtifactMismatch(f"{stage} answered a malformed tensor: {e}") from None
