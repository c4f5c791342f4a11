"""gRPC sides of the query generator: connecting, GetInfo, and the two ways of answering a query.

``gateway_send`` calls RecommendService.Recommend and takes the per-stage timings from the response;
``component_send`` walks the chain itself (features.AugmentUser -> retrieval.Retrieve ->
features.AugmentItems -> ranking.Rank), timing each call from the client, the way the classic latency
pipeline demo runs each component one by one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import grpc.aio

from recpipe import codec
from recpipe.config import STAGES, TOTAL_STAGE, normalize_target
from recpipe.errors import BadRequest, UsageError
from recpipe.gateway.chain import top_n
from recpipe.querygen.loops import Outcome, Send
from recpipe.querygen.workload import QueryStream
from recpipe.v1 import (
    features_pb2,
    features_pb2_grpc,
    info_pb2,
    info_pb2_grpc,
    ranking_pb2,
    ranking_pb2_grpc,
    recommend_pb2,
    recommend_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


async def connect(target: str, timeout: float = 4.0) -> grpc.aio.Channel:
    """An insecure channel to ``target`` that is READY, or UsageError within ``timeout`` seconds.

    ``:PORT`` means 127.0.0.1:PORT. A refused connection fails at once (TRANSIENT_FAILURE) rather than
    retrying until the timeout; the message says how long it actually waited and why it gave up.
    """
    target = normalize_target(target or "")
    if not target or ":" not in target:
        raise UsageError(f"target must be HOST:PORT (or :PORT for 127.0.0.1), got {target!r}")
    t0 = time.perf_counter()
    channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)

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
) -> Send:
    """Run the chain from the client; the query's deadline is shared by its four calls."""
    feat = features_pb2_grpc.FeatureServiceStub(features)
    retrieve = retrieval_pb2_grpc.RetrievalServiceStub(retrieval).Retrieve
    rank = ranking_pb2_grpc.RankingServiceStub(ranking).Rank

    async def send(i: int) -> Outcome:
        user_id, k = queries[i]
        t0 = time.perf_counter()
        deadline = t0 + timeout
        try:
            user = await feat.AugmentUser(features_pb2.AugmentUserRequest(user_id=user_id),
                                          timeout=deadline - time.perf_counter())
            t1 = time.perf_counter()
            cands = await retrieve(
                retrieval_pb2.RetrieveRequest(user_dense=user.dense, user_sparse=user.sparse,
                                              recent_items=user.recent_items, k=k),
                timeout=deadline - t1)
            t2 = time.perf_counter()
            items = await feat.AugmentItems(
                features_pb2.AugmentItemsRequest(user_id=user_id, item_ids=cands.item_ids),
                timeout=deadline - t2)
            t3 = time.perf_counter()
            ranked = await rank(
                ranking_pb2.RankRequest(user_dense=user.dense, user_sparse=user.sparse,
                                        item_dense=items.dense, item_sparse=items.sparse),
                timeout=deadline - t3)
            t4 = time.perf_counter()
        except grpc.aio.AioRpcError as e:
            return e.code().name, ()
        # The gateway's last step, so the client path does the same work: top-n of the scores.
        try:
            ids = codec.decode(cands.item_ids, "item_ids", "int64", (None,))
            scores = codec.decode(ranked.scores, "scores", "float32", (ids.shape[0],))
        except BadRequest:
            return "BAD_RESPONSE", ()
        top_n(ids, scores, num_results)
        t5 = time.perf_counter()
        servers = (user.server_us, cands.server_us, items.server_us, ranked.server_us)
        observed = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        timings = [(s, int(sv), int(ob * 1e6)) for s, sv, ob in zip(STAGES, servers, observed, strict=True)]
        timings.append((TOTAL_STAGE, int(sum(servers)), int((t5 - t0) * 1e6)))
        return "OK", timings

    return send
