"""The gateway's hops as stream messages over real gRPC (``recpipe.gateway.streams``): the stages'
``<Method>Stream`` RPCs (one answer per message, by its sequence, each entry its own answer or error),
a gateway over streams answering as one over RPCs, and a hop's stream across a stage restart, its
rotation, a caller's deadline and a stage without streams."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest
from grpc import aio
from test_batched_hops import _recommend_all, assert_same_answers, wait_serving
from toy_stages import ToyFeatureCore, ToyWorld

from recpipe.features.servicer import FeatureStage
from recpipe.gateway.options import GatewayOptions
from recpipe.gateway.servicer import GatewayStage
from recpipe.gateway.streams import HopStream, StreamBroken
from recpipe.serving.channels import make_channel
from recpipe.serving.server import ServerThread
from recpipe.serving.supervisor import free_port
from recpipe.v1 import features_pb2, features_pb2_grpc

USERS = list(range(10))


def requests_of(server, method: str) -> float:  # type: ignore[no-untyped-def]
    """The stage's own count of ``method`` requests (a stream's: its messages)."""
    value = server.metrics.registry.get_sample_value(
        "recpipe_requests_total", {"stage": server.stage.name, "method": method})
    return value or 0.0


def errors_of(server, method: str, code: str) -> float:  # type: ignore[no-untyped-def]
    value = server.metrics.registry.get_sample_value(
        "recpipe_errors_total", {"stage": server.stage.name, "method": method, "code": code})
    return value or 0.0


def test_a_stream_answers_each_message_by_its_sequence_and_each_entry_alone(serving_chain) -> None:
    features = serving_chain.features
    before = requests_of(features, "FeatureService/AugmentUserStream")
    errors = [errors_of(features, "FeatureService/AugmentUserStream", code) for code in ("NOT_FOUND", "DEADLINE_EXCEEDED")]

    async def go() -> list[features_pb2.AugmentUserBatchResponse]:
        async with aio.insecure_channel(features.address) as channel:
            call = features_pb2_grpc.FeatureServiceStub(channel).AugmentUserStream()
            await call.write(features_pb2.AugmentUserBatchRequest(
                entries=[features_pb2.AugmentUserRequest(user_id=u) for u in (4, 10**9, 5)], sequence=7))
            await call.write(features_pb2.AugmentUserBatchRequest(
                entries=[features_pb2.AugmentUserRequest(user_id=6)], timeout_us=[5_000_000], sequence=8))
            await call.write(features_pb2.AugmentUserBatchRequest(
                entries=[features_pb2.AugmentUserRequest(user_id=6)], timeout_us=[1], sequence=9))
            await call.done_writing()
            return [reply async for reply in call]

    replies = {r.sequence: r for r in asyncio.run(go())}
    assert sorted(replies) == [7, 8, 9]
    assert [e.WhichOneof("result") for e in replies[7].entries] == ["ok", "error", "ok"]
    assert replies[7].entries[1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert replies[8].entries[0].ok.user_id == 6
    # 1 µs left: DEADLINE_EXCEEDED for that entry, the stream goes on
    assert replies[9].entries[0].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    with grpc.insecure_channel(features.address) as channel:
        alone = features_pb2_grpc.FeatureServiceStub(channel).AugmentUser(features_pb2.AugmentUserRequest(user_id=4))
    assert replies[7].entries[0].ok.dense.data == alone.dense.data
    assert requests_of(features, "FeatureService/AugmentUserStream") - before == 3  # each message a request
    # each failed entry is counted under its status, as a failed call would be
    assert [errors_of(features, "FeatureService/AugmentUserStream", code) - e
            for code, e in zip(("NOT_FOUND", "DEADLINE_EXCEEDED"), errors, strict=True)] == [1, 1]


@pytest.fixture(scope="module")
def transports(serving_chain, serving_threads):
    """Two gateways over the session's stages: hops over streams (the default) and over RPCs."""
    targets = [serving_chain[name].address for name in ("features", "retrieval", "ranking")]
    streams = serving_threads.start(GatewayStage(*targets, GatewayOptions()))
    rpcs = serving_threads.start(GatewayStage(*targets, GatewayOptions(hop_transport="rpc")))
    yield streams, rpcs
    for g in (streams, rpcs):
        serving_threads.stop(g)


def test_a_gateway_over_streams_answers_as_one_over_rpcs(transports, serving_chain, dataset_info) -> None:
    streams, rpcs = transports
    users = [*USERS, dataset_info["num_users"] + 5, *USERS]  # one unknown user among them
    for g in (streams, rpcs):
        wait_serving(g.address)
    ranking = serving_chain.ranking
    counted = ("RankingService/Rank", "RankingService/RankBatch", "RankingService/RankStream")
    before = [requests_of(ranking, m) for m in counted]
    got = _recommend_all(streams.address, users, concurrency=len(users))
    middle = [requests_of(ranking, m) for m in counted]
    want = _recommend_all(rpcs.address, users, concurrency=4)
    after = [requests_of(ranking, m) for m in counted]
    assert_same_answers(got, want)
    # the stream gateway's Rank calls all went as stream messages, the other's as RPCs
    over_streams = [m - b for m, b in zip(middle, before, strict=True)]
    over_rpcs = [a - m for a, m in zip(after, middle, strict=True)]
    assert over_streams[:2] == [0, 0] and 0 < over_streams[2] <= len(USERS) * 2, over_streams
    assert over_rpcs[2] == 0 and over_rpcs[0] + over_rpcs[1] > 0, over_rpcs
    opened = re.fullmatch(r"stream \((\d+) streams opened, (\d+) calls sent again\)", streams.stage.info().details["transport"])
    assert opened is not None and int(opened.group(1)) >= 4  # one per hop at least (a new one every 5 s)
    assert rpcs.stage.info().details["transport"] == "rpc"


def _user_batch(*users: int, timeout_us: int = 0) -> features_pb2.AugmentUserBatchRequest:
    return features_pb2.AugmentUserBatchRequest(entries=[features_pb2.AugmentUserRequest(user_id=u) for u in users],
                                                timeout_us=[timeout_us] * len(users))


def test_a_hop_stream_outlives_a_stage_restart_rotates_and_keeps_its_deadline() -> None:
    world = ToyWorld()
    port = free_port()
    with ServerThread() as st:
        first = st.start(FeatureStage(lambda: ToyFeatureCore(world)), port=port)

        async def go() -> HopStream:
            channel = make_channel(f"127.0.0.1:{port}")
            stream = HopStream("features.AugmentUser", features_pb2_grpc.FeatureServiceStub(channel).AugmentUserStream)
            try:
                reply = await stream(_user_batch(3, 4), 10)
                assert [e.ok.user_id for e in reply.entries] == [3, 4]
                # the stage restarts on the same port: the stream that had answered is replaced, and a
                # call that met the broken one is sent again on the new one
                # its open stream ends once answered: the stop does not wait out its 5 s grace for it
                began = time.monotonic()
                await asyncio.to_thread(st.stop, first, 5.0)
                assert time.monotonic() - began < 2.5
                await asyncio.to_thread(st.start, FeatureStage(lambda: ToyFeatureCore(world)), port=port)
                await asyncio.wait_for(channel.channel_ready(), 30)
                reply = await stream(_user_batch(5), 10)
                assert reply.entries[0].ok.user_id == 5
                assert stream.opened == 2
                # past its age a stream takes no new calls: each call here opens a new one, and the
                # old ones still deliver what they owe
                stream.max_age_s = 0.0
                replies = await asyncio.gather(*(stream(_user_batch(u), 10) for u in (6, 7, 8)))
                assert [r.entries[0].ok.user_id for r in replies] == [6, 7, 8]
                assert stream.opened == 5
                stream.max_age_s = 60.0
                # a caller whose time is up gets TimeoutError, and the stream goes on: its write is not
                # the caller's (grpc.aio cancels a whole stream whose write is cancelled)
                opened = stream.opened
                for _ in range(20):
                    with pytest.raises(TimeoutError):
                        await stream(_user_batch(9, timeout_us=1), 1e-6)
                assert (await stream(_user_batch(9), 10)).entries[0].ok.user_id == 9
                assert stream.opened == opened and stream.resent == 0
                return stream
            finally:
                await stream.close()
                await channel.close()

        asyncio.run(go())


def test_a_stage_without_streams_is_unimplemented_and_marks_the_stream_unsupported() -> None:
    async def go() -> HopStream:
        server = aio.server()  # a gRPC server with no FeatureService, as an older stage has no stream
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = make_channel(f"127.0.0.1:{port}")
        stream = HopStream("features.AugmentUser", features_pb2_grpc.FeatureServiceStub(channel).AugmentUserStream)
        try:
            with pytest.raises(StreamBroken) as broken:
                await stream(_user_batch(3), 10)
            assert broken.value.code == grpc.StatusCode.UNIMPLEMENTED
            return stream
        finally:
            await stream.close()
            await channel.close()
            await server.stop(None)

    assert asyncio.run(go()).unsupported
