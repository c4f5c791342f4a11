"""gRPC sides of the query generator: connecting, GetInfo, and the two ways of answering a query.

``gateway_send`` calls RecommendService.Recommend and takes the per-stage timings from the response;
``component_send`` walks the chain itself (features.AugmentUser -> retrieval.Retrieve ->
features.AugmentItems -> ranking.Rank) with the gateway's ``Chain`` over gRPC stage clients, timing
each call from the client, the way the classic latency pipeline demo runs each component one by one.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from recpipe.config import normalize_target
from recpipe.errors import RecpipeError, UsageError
from recpipe.gateway import UPSTREAM
from recpipe.gateway.chain import Chain
from recpipe.gateway.clients import GrpcFeatureClient, GrpcRankingClient, GrpcRetrievalClient
from recpipe.querygen.loops import Outcome, Send
from recpipe.querygen.workload import QueryStream, UserSpec
from recpipe.serving.channels import make_channel
from recpipe.serving.status import RemoteError, code_for
from recpipe.stages import REGISTRY
from recpipe.v1 import info_pb2, info_pb2_grpc, recommend_pb2, recommend_pb2_grpc

if TYPE_CHECKING:
    from recpipe.querygen.config import QuerygenConfig

#: the role the gateway plays in ``roles``/``open_roles`` (the chain's entry)
GATEWAY_ROLE = REGISTRY.entry.name


async def connect(target: str, timeout: float = 4.0) -> grpc.aio.Channel:
    """An insecure channel to ``target`` that is READY, or UsageError within ``timeout`` seconds.

    ``:PORT`` means 127.0.0.1:PORT. A refused connection fails at once (TRANSIENT_FAILURE) rather than
    retrying until the timeout; the message says how long it actually waited and why it gave up.
    """
    target = normalize_target(target or "")
    if not target or ":" not in target:
        raise UsageError(f"target must be HOST:PORT (or :PORT for 127.0.0.1), got {target!r}")
    t0 = time.perf_counter()
    channel = make_channel(target)

    async def ready() -> bool:
        while True:
            state = channel.get_state(try_to_connect=True)
            if state is grpc.ChannelConnectivity.READY:
                return True
            if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                return False
            await channel.wait_for_state_change(state)

    timed_out = False
    try:
        ok = await asyncio.wait_for(ready(), timeout)
    except TimeoutError:
        ok, timed_out = False, True
    if not ok:
        waited = time.perf_counter() - t0
        await channel.close(None)
        why = (f"no answer within {waited:.2f} s (the limit)" if timed_out
               else f"connection failed after {waited:.2f} s (limit {timeout:g} s)")
        raise UsageError(f"cannot reach {target}: {why}; is the server running?")
    return channel


async def get_info(channel: grpc.aio.Channel, timeout: float = 5.0) -> dict[str, Any] | None:
    """The server's InfoService.GetInfo as a dict, or None when it does not serve InfoService."""
    try:
        info = await info_pb2_grpc.InfoServiceStub(channel).GetInfo(info_pb2.GetInfoRequest(), timeout=timeout)
    except grpc.aio.AioRpcError:
        return None
    return {
        "stage": info.stage,
        "device": info.device,
        "model_version": info.model_version,
        "recpipe_version": info.recpipe_version,
        "threads": info.threads,
        "details": dict(info.details),
    }


def roles(config: QuerygenConfig) -> dict[str, str]:
    """Role -> address the run talks to: the gateway (``--target``) and, with ``--per-component``,
    features / retrieval / ranking."""
    out: dict[str, str] = {}
    if config.target:
        out[GATEWAY_ROLE] = config.target
    if config.per_component:
        out.update(config.stage_targets)
    return out


async def open_roles(targets: dict[str, str], timeout: float) -> tuple[dict[str, grpc.aio.Channel],
                                                                         list[grpc.aio.Channel]]:
    """A READY channel per role, one per distinct address (a single test server may play every role);
    returns (role -> channel, the distinct channels to close)."""
    by_role: dict[str, grpc.aio.Channel] = {}
    distinct: list[grpc.aio.Channel] = []
    by_address: dict[str, grpc.aio.Channel] = {}
    try:
        for name, target in targets.items():
            if target not in by_address:
                by_address[target] = await connect(target, timeout)
                distinct.append(by_address[target])
            by_role[name] = by_address[target]
    except BaseException:
        for channel in distinct:
            await channel.close(None)
        raise
    return by_role, distinct


def send_for(config: QuerygenConfig, channels: dict[str, grpc.aio.Channel], num_users: int) -> Send:
    """How this run answers query ``i``: the gateway's Recommend, or the chain walked from the client
    with ``--per-component``; queries drawn from the run's seeded stream over ``num_users`` users."""
    users = UserSpec(config.users, num_users, config.zipf_exponent)
    queries = QueryStream(users, config.candidates, config.seed)
    if config.per_component:
        features, retrieval, ranking = (channels[name] for name in UPSTREAM)
        return component_send(features, retrieval, ranking, queries, config.num_results, config.timeout,
                              targets=roles(config))
    return gateway_send(channels[GATEWAY_ROLE], queries, config.num_results, config.timeout)


def gateway_send(channel: grpc.aio.Channel, queries: QueryStream, num_results: int, timeout: float) -> Send:
    recommend = recommend_pb2_grpc.RecommendServiceStub(channel).Recommend
    request = recommend_pb2.RecommendRequest

    async def send(i: int) -> Outcome:
        user_id, k = queries[i]
        try:
            resp = await recommend(request(user_id=user_id, num_candidates=k, num_results=num_results),
                                   timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return e.code().name, ()
        # queue/compute/batch_size: getattr with 0, so a gateway built before they existed still works.
        return "OK", [(t.stage, t.server_us, t.observed_us, getattr(t, "queue_us", 0),
                       getattr(t, "compute_us", 0), getattr(t, "batch_size", 0)) for t in resp.timings]

    return send


def component_send(
    features: grpc.aio.Channel,
    retrieval: grpc.aio.Channel,
    ranking: grpc.aio.Channel,
    queries: QueryStream,
    num_results: int,
    timeout: float,
    targets: dict[str, str] | None = None,
) -> Send:
    """Run the chain from the client: the gateway's own ``Chain`` over the gRPC stage clients, so the
    four calls, the deadline they share and the final top-n are exactly the gateway's. ``targets``
    names the stages' addresses in error messages."""
    names = {"features": "features", "retrieval": "retrieval", "ranking": "ranking", **(targets or {})}
    chain: Chain[Any, Any] = Chain(
        GrpcFeatureClient(names["features"], features), GrpcRetrievalClient(names["retrieval"], retrieval),
        GrpcRankingClient(names["ranking"], ranking),
    )

    async def send(i: int) -> Outcome:
        user_id, k = queries[i]
        try:
            rec = await chain.recommend(user_id, k, num_results, time.monotonic() + timeout)
        except RecpipeError as e:
            return _code_name(e), ()
        # each stage's own split too, as through the gateway (it was dropped here, and the table then
        # said the stages report none)
        return "OK", [(t.stage, t.server_us, t.observed_us, t.queue_us, t.compute_us, t.batch_size)
                      for t in rec.timings]

    return send


def _code_name(error: RecpipeError) -> str:
    """The status code name a failed hop answered with (an unmapped one keeps its own code)."""
    return error.code.name if isinstance(error, RemoteError) else code_for(error).name
