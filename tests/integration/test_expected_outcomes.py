"""Expected outcomes (a deadline that passed, a cancelled call, a refusal) are counted and logged as counts at
most once per interval, never as tracebacks, on real gRPC servers: the real chain under a deadline it
cannot always meet, a stage whose loop is held past its callers' deadlines, and ``OutcomeLog`` itself."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import Counter
from typing import Any

import grpc
import numpy as np
import pytest
from grpc import aio

from recpipe.errors import DeadlineExceeded, Overloaded
from recpipe.serving import codec
from recpipe.serving.outcomes import Outcome, OutcomeLog
from recpipe.serving.server import ServerThread, StageServer
from recpipe.serving.stage import Stage, StageInfo
from recpipe.v1 import features_pb2, features_pb2_grpc, recommend_pb2, recommend_pb2_grpc

#: What must never reach the log for an expected outcome.
TRACEBACK_MARKS = ("Traceback", "ExecuteBatchError", "Unexpected")


def assert_no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    for mark in TRACEBACK_MARKS:
        assert mark not in caplog.text, caplog.text[:3000]


def flush(servers: ServerThread, *stages: StageServer) -> None:
    """Write the pending counts of ``stages`` to the log now, as a stop would."""

    async def go() -> None:
        for server in stages:
            server.metrics.outcomes.flush()

    servers.run(go())


def test_a_tight_deadline_on_the_chain_logs_counts_not_tracebacks(serving_chain, serving_threads, caplog):
    caplog.set_level(logging.WARNING)
    codes: Counter[str] = Counter()

    async def calls() -> None:
        async with aio.insecure_channel(serving_chain.gateway.address) as channel:
            stub = recommend_pb2_grpc.RecommendServiceStub(channel)
            await stub.Recommend(recommend_pb2.RecommendRequest(user_id=1), timeout=30)  # connected and warm
            for i in range(200):
                try:
                    await stub.Recommend(recommend_pb2.RecommendRequest(user_id=i % 50), timeout=0.004)
                    codes["OK"] += 1
                except aio.AioRpcError as e:
                    codes[e.code().name] += 1

    asyncio.run(calls())
    time.sleep(0.2)  # let the stages finish the calls they were still working on
    flush(serving_threads, *serving_chain.servers.values())
    assert set(codes) <= {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}, codes
    assert codes["DEADLINE_EXCEEDED"] > 0, codes  # 4 ms is less than this chain takes on a CPU
    assert_no_tracebacks(caplog)
    gateway_lines = [r.getMessage() for r in caplog.records
                     if r.name == "recpipe.serving.outcomes" and r.getMessage().startswith("gateway: ")]
    assert any("request(s) out of time" in line or "request(s) past their deadline" in line
               for line in gateway_lines), gateway_lines


class LateStage(Stage, features_pb2_grpc.FeatureServiceServicer):
    """A stage whose AugmentUser holds the event loop (as a long inline core call would) for about its
    caller's deadline, then answers with a large reply or raises ``DeadlineExceeded``: the deadline
    often passes while the status or the reply is being sent."""

    name = "late"
    service_names = ("recpipe.v1.FeatureService",)
    REPLY = codec.encode(np.zeros(250_000, np.float32))  # 1 MB: its send takes a while

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.rng = random.Random(0)

    def add_to_server(self, server: aio.Server) -> None:
        features_pb2_grpc.add_FeatureServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    async def load(self) -> None:
        return None

    def info(self) -> StageInfo:
        return StageInfo(self.name)

    async def AugmentUser(self, request: Any, context: aio.ServicerContext) -> Any:
        time.sleep(self.timeout_s * self.rng.uniform(0.6, 1.4))
        if request.user_id % 2:
            raise DeadlineExceeded("late: out of time")
        return features_pb2.AugmentUserResponse(user_id=request.user_id, dense=self.REPLY)

    async def AugmentItems(self, request: Any, context: aio.ServicerContext) -> Any:
        raise Overloaded("late: busy")


def test_answers_and_statuses_too_late_to_send_are_counted_not_tracebacked(servers, caplog):
    caplog.set_level(logging.WARNING)
    timeout_s = 0.009
    server = servers.start(LateStage(timeout_s))
    codes: Counter[str] = Counter()

    async def calls() -> None:
        async with aio.insecure_channel(server.address, options=[("grpc.max_receive_message_length", 1 << 24)]) as ch:
            stub = features_pb2_grpc.FeatureServiceStub(ch)
            gate = asyncio.Semaphore(4)

            async def one(user: int) -> None:
                async with gate:
                    try:
                        await stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=user), timeout=timeout_s)
                        codes["OK"] += 1
                    except aio.AioRpcError as e:
                        codes[e.code().name] += 1

            await asyncio.gather(*(one(i) for i in range(300)))

    try:
        asyncio.run(calls())
        time.sleep(0.3)
        flush(servers, server)
        expired = server.metrics.registry.get_sample_value(
            "recpipe_errors_total", {"stage": "late", "method": "FeatureService/AugmentUser", "code": "DEADLINE_EXCEEDED"})
    finally:
        servers.stop(server)
    assert set(codes) <= {"OK", "DEADLINE_EXCEEDED"} and codes["DEADLINE_EXCEEDED"] > 0, codes
    assert_no_tracebacks(caplog)
    assert expired is not None and expired > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "recpipe.serving.outcomes"]
    assert any(line.startswith("late: ") and "past their deadline" in line for line in lines), lines


def test_a_status_the_caller_can_still_receive_is_sent(servers, caplog):
    """DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED raised with time left reach the caller with their message,
    and are logged as counts."""
    caplog.set_level(logging.WARNING)
    stage = LateStage(0.0)
    server = servers.start(stage)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = features_pb2_grpc.FeatureServiceStub(channel)
            with pytest.raises(grpc.RpcError) as late:
                stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=1), timeout=10)
            with pytest.raises(grpc.RpcError) as busy:
                stub.AugmentItems(features_pb2.AugmentItemsRequest(user_id=1), timeout=10)
    finally:
        servers.stop(server)
    assert (late.value.code(), late.value.details()) == (grpc.StatusCode.DEADLINE_EXCEEDED, "late: out of time")
    assert (busy.value.code(), busy.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "late: busy")
    lines = [r.getMessage() for r in caplog.records if r.name == "recpipe.serving.outcomes"]
    assert any("late: 1 request(s) out of time answered DEADLINE_EXCEEDED" in line for line in lines), lines
    assert any("late: 1 request(s) refused with RESOURCE_EXHAUSTED" in line and "late: busy" in line
               for line in lines), lines
    assert_no_tracebacks(caplog)


def test_a_cancelled_call_is_counted_as_cancelled(servers, caplog):
    caplog.set_level(logging.WARNING)
    entered, release = threading.Event(), asyncio.Event()

    class Waiting(LateStage):
        async def AugmentUser(self, request: Any, context: aio.ServicerContext) -> Any:
            entered.set()
            await release.wait()
            return features_pb2.AugmentUserResponse(user_id=request.user_id)

    server = servers.start(Waiting(0.0))
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = features_pb2_grpc.FeatureServiceStub(channel).AugmentUser.future(
                features_pb2.AugmentUserRequest(user_id=2), timeout=30)
            assert entered.wait(10)
            call.cancel()
            labels = {"stage": "late", "method": "FeatureService/AugmentUser", "code": "CANCELLED"}
            deadline = time.monotonic() + 10
            while not server.metrics.registry.get_sample_value("recpipe_errors_total", labels):
                assert time.monotonic() < deadline, "the cancellation was never counted"
                time.sleep(0.01)
    finally:
        servers.stop(server)
    lines = [r.getMessage() for r in caplog.records if r.name == "recpipe.serving.outcomes"]
    assert any("late: 1 request(s) cancelled by the caller" in line for line in lines), lines
    assert_no_tracebacks(caplog)


def test_outcome_log_is_rate_limited_per_kind_with_a_count(caplog):
    now = [100.0]
    log = OutcomeLog("ranking", every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="recpipe.serving.outcomes"):
        for _ in range(30):
            log.record(Outcome.EXPIRED, "RankingService/Rank", "answered after its deadline")
            now[0] += 0.1
        log.record(Outcome.REFUSED, "RankingService/Rank", "ranking.Rank: queue full")  # its own kind: at once
        now[0] += 8.0
        log.record(Outcome.EXPIRED, "RankingService/Rank", "ranking: deadline passed before the stage started")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("ranking: 1 request(s) past their deadline ended unanswered")
    assert lines[1].startswith("ranking: 1 request(s) refused with RESOURCE_EXHAUSTED")
    assert lines[2].startswith("ranking: 30 request(s) past their deadline in the last 11s")
    assert lines[2].endswith("latest: RankingService/Rank: ranking: deadline passed before the stage started")
    assert all(r.exc_info is None for r in caplog.records)


def test_outcome_log_writes_the_interval_count_on_its_loop_and_flushes_the_rest(caplog):
    async def go() -> None:
        log = OutcomeLog("gateway", every_s=0.05)
        for _ in range(5):
            log.record(Outcome.DEADLINE, "RecommendService/Recommend", "deadline exceeded in ranking")
        for _ in range(200):  # the interval's line, from a timer on this loop, with no record after it
            if len(caplog.records) == 2:
                break
            await asyncio.sleep(0.01)
        log.record(Outcome.CANCELLED, "RecommendService/Recommend", "cancelled")
        log.record(Outcome.CANCELLED, "RecommendService/Recommend", "cancelled")
        log.flush()  # the server stops: what is pending is written
        log.flush()  # and nothing twice

    with caplog.at_level(logging.WARNING, logger="recpipe.serving.outcomes"):
        asyncio.run(go())
    lines = [r.getMessage().split(";")[0] for r in caplog.records]
    assert len(lines) == 4, lines
    assert lines[0] == "gateway: 1 request(s) out of time answered DEADLINE_EXCEEDED"
    assert lines[1].startswith("gateway: 4 request(s) out of time in the last 0.0")  # 0.05 s, by the timer
    assert lines[1].endswith("s answered DEADLINE_EXCEEDED")
    assert lines[2] == "gateway: 1 request(s) cancelled by the caller, ended unanswered"
    assert lines[3].startswith("gateway: 1 request(s) cancelled in the last 0.")  # by the flush
