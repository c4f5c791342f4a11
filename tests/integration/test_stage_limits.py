"""What a stage takes in, on real gRPC servers over toy stage cores: a batch or stream message over
``MAX_BATCH_ENTRIES`` entries or ``MAX_BATCH_ROWS`` rows is refused before any work and the stage keeps
serving (90,000 entries in one AugmentUserBatch held a stage's loop until its supervisor killed it), an
entry whose deadline passes while its batch computes is answered DEADLINE_EXCEEDED (not OK, late), a
negative ``timeout_us`` fails its entry alone, and calls that pile up while the loop is busy reach the
stage instead of being cancelled by gRPC."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from toy_stages import ITEM_SPARSE, USER_SPARSE, ToyFeatureCore, ToyRankingCore

from recpipe.config import MAX_BATCH_ENTRIES, MAX_BATCH_ROWS, MAX_NUM_CANDIDATES
from recpipe.features.servicer import FeatureStage
from recpipe.ranking.servicer import RankingStage
from recpipe.serving import codec
from recpipe.serving.channels import make_blocking_channel
from recpipe.v1 import features_pb2, features_pb2_grpc, ranking_pb2, ranking_pb2_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


@pytest.fixture(scope="module")
def features(servers, world):
    server = servers.start(FeatureStage(lambda: ToyFeatureCore(world)))
    with make_blocking_channel(server.address) as channel:  # the chain's message limits (64 MiB)
        yield features_pb2_grpc.FeatureServiceStub(channel), health_pb2_grpc.HealthStub(channel)
    servers.stop(server)


def _serving(health) -> bool:  # type: ignore[no-untyped-def]
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING  # type: ignore[no-any-return]


def _users(n: int) -> features_pb2.AugmentUserBatchRequest:
    return features_pb2.AugmentUserBatchRequest(entries=[features_pb2.AugmentUserRequest(user_id=i % 60)
                                                         for i in range(n)])


def _items(entries: int, ids: int) -> features_pb2.AugmentItemsBatchRequest:
    item_ids = codec.encode(np.arange(ids, dtype=np.int64) % 400)
    return features_pb2.AugmentItemsBatchRequest(
        entries=[features_pb2.AugmentItemsRequest(user_id=1, item_ids=item_ids) for _ in range(entries)])


def test_a_batch_message_over_the_entries_limit_is_refused_whole_and_the_stage_keeps_serving(features) -> None:
    stub, health = features
    reply = stub.AugmentUserBatch(_users(MAX_BATCH_ENTRIES), timeout=30)
    assert len(reply.entries) == MAX_BATCH_ENTRIES and all(e.WhichOneof("result") == "ok" for e in reply.entries)
    for n in (MAX_BATCH_ENTRIES + 1, 90_000):
        with pytest.raises(grpc.RpcError) as info:
            stub.AugmentUserBatch(_users(n), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == f"features: {n} entries in one batch message, at most {MAX_BATCH_ENTRIES}"
        assert _serving(health)
    # on a stream, such a message ends the stream with the same status; a new stream is served
    with pytest.raises(grpc.RpcError) as info:
        list(stub.AugmentUserStream(iter([_users(3), _users(90_000)]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    answers = list(stub.AugmentUserStream(iter([_users(3)]), timeout=30))
    assert [e.ok.user_id for e in answers[0].entries] == [0, 1, 2]


def test_a_batch_message_over_the_rows_limit_is_refused_before_any_work(features) -> None:
    stub, health = features
    per_entry = MAX_NUM_CANDIDATES
    fits = MAX_BATCH_ROWS // per_entry
    reply = stub.AugmentItemsBatch(_items(fits, per_entry), timeout=60)
    assert all(e.ok.dense.shape[0] == per_entry for e in reply.entries)
    with pytest.raises(grpc.RpcError) as info:
        stub.AugmentItemsBatch(_items(fits + 1, per_entry), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{(fits + 1) * per_entry} rows in one batch message" in (info.value.details() or "")
    # on a stream: each entry's error, the stream goes on
    request = _items(fits + 1, per_entry)
    request.sequence = 7
    over, ok = list(stub.AugmentItemsStream(iter([request, _items(2, 5)]), timeout=60))
    assert over.sequence == 7 and {e.error.code for e in over.entries} == {INVALID}
    assert [e.ok.dense.shape[0] for e in ok.entries] == [5, 5]
    assert _serving(health)


def _before_each_call(core: object, method: str, hook: Callable[[], object]) -> None:
    """Make ``core.<method>`` run ``hook()`` before each call, then the method itself."""
    original = getattr(core, method)

    def wrapped(*args: object) -> object:
        hook()
        return original(*args)

    setattr(core, method, wrapped)


def _rank_request(k: int = 4) -> ranking_pb2.RankRequest:
    return ranking_pb2.RankRequest(
        user_dense=codec.encode(np.ones(8, np.float32)), user_sparse=codec.encode(np.zeros(USER_SPARSE, np.int64)),
        item_dense=codec.encode(np.ones((k, 6), np.float32)), item_sparse=codec.encode(np.zeros((k, ITEM_SPARSE), np.int64)))


def test_an_entry_whose_deadline_passes_while_its_batch_computes_is_answered_deadline_exceeded(servers, world) -> None:
    core = ToyRankingCore(world)
    core.delay_s = 0.4  # the batch's one core call
    started = threading.Event()
    _before_each_call(core, "rank_batch", started.set)
    server = servers.start(RankingStage(lambda: core))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = ranking_pb2_grpc.RankingServiceStub(channel)
            # a fresh stage has no service time to refuse by: all four are admitted, into one core call
            timeouts = [100_000, 0, 30_000_000, -5]
            reply = stub.RankBatch(ranking_pb2.RankBatchRequest(entries=[_rank_request()] * 4, timeout_us=timeouts),
                                   timeout=30)
            assert started.is_set()
            kinds = [e.WhichOneof("result") for e in reply.entries]
            assert kinds == ["error", "ok", "ok", "error"]
            assert reply.entries[0].error.code == DEADLINE
            assert "deadline passed while its batch computed" in reply.entries[0].error.message
            assert reply.entries[3].error.code == INVALID and "timeout_us must be >= 0" in reply.entries[3].error.message
            assert reply.entries[1].ok.batch_size == 3  # the three live entries in one core call
            core.delay_s = 0.0
            assert stub.Rank(_rank_request(), timeout=10).scores.shape == [4]
    finally:
        servers.stop(server)


def test_calls_that_pile_up_while_the_loop_is_busy_reach_the_stage_not_cancelled_by_grpc(servers, world) -> None:
    """2,000 calls arriving while the server's event loop is held for a second: each gets its answer or
    the stage's own refusal, none CANCELLED by gRPC's pending-call limit before the stage saw it."""
    import asyncio
    import collections
    import time

    from grpc import aio

    server = servers.start(FeatureStage(lambda: ToyFeatureCore(world)))

    async def burst() -> collections.Counter[str]:
        async with aio.insecure_channel(server.address) as channel:
            stub = features_pb2_grpc.FeatureServiceStub(channel)
            await stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=1), timeout=10)

            async def call(i: int) -> str:
                try:
                    await stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=i % 60), timeout=30)
                    return "OK"
                except aio.AioRpcError as e:
                    return e.code().name

            tasks = [asyncio.ensure_future(call(i)) for i in range(2000)]
            await asyncio.sleep(0.05)
            servers.loop.call_soon_threadsafe(time.sleep, 1.0)  # the stage's loop busy while they arrive
            return collections.Counter(await asyncio.gather(*tasks))

    try:
        codes = asyncio.run(burst())
    finally:
        servers.stop(server)
    assert "CANCELLED" not in codes, codes
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"} and codes["OK"] > 0, codes


def test_more_timeouts_than_entries_is_refused_not_ignored(features) -> None:
    """Which entries would ``timeout_us`` [1, 0, 30 s] with two entries time? The caller's misalignment:
    refused before any work, the batch call whole, on a stream each entry; the stream goes on."""
    stub, health = features
    request = _users(2)
    request.timeout_us.extend([1_000, 0, 30_000_000])
    with pytest.raises(grpc.RpcError) as info:
        stub.AugmentUserBatch(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "features: 3 timeout_us for 2 entries (at most one per entry; fewer: the rest " \
                                   "have the call's deadline)"
    request.sequence = 4
    over, ok = list(stub.AugmentUserStream(iter([request, _users(2)]), timeout=30))
    assert over.sequence == 4 and [e.error.code for e in over.entries] == [INVALID, INVALID]
    assert [e.ok.user_id for e in ok.entries] == [0, 1]
    # as many as the entries, or fewer, is the contract: the rest have the call's deadline
    fewer = _users(3)
    fewer.timeout_us.extend([30_000_000])
    assert [e.WhichOneof("result") for e in stub.AugmentUserBatch(fewer, timeout=30).entries] == ["ok"] * 3
    assert _serving(health)


def test_a_stream_whose_caller_does_not_read_its_answers_is_held_back_not_buffered(servers, world, caplog) -> None:
    """A caller that sends 400 messages of 256 entries and reads nothing: the stage answers
    ``MAX_STREAM_MESSAGES`` of them (and what flow control lets through), then stops reading, instead
    of computing and buffering all 102,400 answers (one such caller grew a feature stage by 4 GB)."""
    import gc
    import logging
    import time

    from recpipe.config import MAX_STREAM_MESSAGES

    caplog.set_level(logging.WARNING)

    core = ToyFeatureCore(world)
    computed: list[None] = []
    _before_each_call(core, "user_features", lambda: computed.append(None))
    server = servers.start(FeatureStage(lambda: core))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = features_pb2_grpc.FeatureServiceStub(channel)

            def messages():  # type: ignore[no-untyped-def]
                for sequence in range(400):
                    request = _users(MAX_BATCH_ENTRIES)
                    request.sequence = sequence
                    yield request

            call = stub.AugmentUserStream(messages(), timeout=60)  # never read
            time.sleep(2.5)
            held = len(computed)
            time.sleep(0.5)
            still = len(computed)
            call.cancel()
            # held back: no more computed once the windows are full (HTTP/2's hold a few MB of answers
            # besides the messages being answered), far from all of them
            assert still == held and held <= (MAX_STREAM_MESSAGES + 96) * MAX_BATCH_ENTRIES, (held, still)
            answers = list(stub.AugmentUserStream(iter([_users(3)]), timeout=30))
            assert [e.ok.user_id for e in answers[0].entries] == [0, 1, 2]
            # the answers whose writes the cancel cut short are counted, not a traceback each
            gc.collect()
            assert not [r for r in caplog.records if r.exc_info or "never retrieved" in r.getMessage()]
    finally:
        servers.stop(server)
