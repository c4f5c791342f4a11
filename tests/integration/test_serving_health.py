"""Health is answered off the compute path: while a core call that may be long is held in the core, the
stage's gRPC health service keeps answering, on real in-process servers with the default ``--workers 0``
(short calls inline on the event loop). The supervised counterpart, a stage whose core call outlasts the
supervisor's ``unresponsive_s`` and is not restarted, is in test_supervisor_toy.py."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from toy_stages import ITEM_SPARSE, USER_SPARSE, ToyFeatureCore, ToyRankingCore, ToyWorld

from recpipe.features.contract import UserQuery
from recpipe.features.servicer import FeatureStage
from recpipe.ranking.contract import RankQuery
from recpipe.ranking.servicer import RankingStage
from recpipe.serving import codec
from recpipe.serving.inline import INLINE_MAX_S
from recpipe.serving.server import ServerThread, StageServer
from recpipe.serving.supervisor import PROBE_TIMEOUT_S
from recpipe.types import UserFeatures
from recpipe.v1 import features_pb2, features_pb2_grpc, ranking_pb2, ranking_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
#: Health checks asked while a call is held.
CHECKS = 10


class Gate:
    """Holds core calls while ``hold`` is set: ``entered`` is set once one waits, ``release()`` lets it go."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.entered = threading.Event()
        self.open = threading.Event()
        self.threads: list[str] = []

    def pass_through(self) -> None:
        self.threads.append(threading.current_thread().name)
        if self.hold.is_set():
            self.entered.set()
            self.open.wait(10)

    def release(self) -> None:
        self.hold.clear()
        self.open.set()


class HeldRankingCore(ToyRankingCore):
    def __init__(self, world: ToyWorld) -> None:
        super().__init__(world)
        self.gate = Gate()

    def rank_batch(self, queries: Sequence[RankQuery]) -> list[np.ndarray]:
        self.gate.pass_through()
        return super().rank_batch(queries)


class HeldFeatureCore(ToyFeatureCore):
    def __init__(self, world: ToyWorld) -> None:
        super().__init__(world)
        self.gate = Gate()

    def user_features(self, query: UserQuery) -> UserFeatures:
        self.gate.pass_through()
        return super().user_features(query)


def rank_request(world: ToyWorld, k: int) -> ranking_pb2.RankRequest:
    rng = np.random.default_rng(k)
    return ranking_pb2.RankRequest(
        user_dense=codec.encode(world.user_dense[1]),
        user_sparse=codec.encode(np.zeros(USER_SPARSE, np.int64)),
        item_dense=codec.encode(rng.normal(size=(k, world.item_dense.shape[1] + 1)).astype(np.float32)),
        item_sparse=codec.encode(rng.integers(0, 3, size=(k, ITEM_SPARSE), dtype=np.int64)),
    )


def health_while_held(server: StageServer, gate: Gate, call: Callable[[grpc.Channel], grpc.Future]) -> list[float]:
    """Hold the call ``call`` makes in the core, ask the stage's health ``CHECKS`` times meanwhile, then
    let the call finish; the seconds each health check took."""
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING  # connected
        gate.hold.set()
        held = call(channel)
        try:
            assert gate.entered.wait(10), "the call never reached the core"
            took = []
            for _ in range(CHECKS):
                start = time.perf_counter()
                # the supervisor's own probe deadline: a check that misses it counts as silence
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
                took.append(time.perf_counter() - start)
                assert reply.status == SERVING
            assert not held.done(), "the call was not held while health was asked"
        finally:
            gate.release()
        held.result(timeout=10)
    return took


def health_while_rank_held(server: StageServer, core: HeldRankingCore, world: ToyWorld, rows: int, after: int = 0
                           ) -> list[float]:
    """``health_while_held`` over a Rank of ``rows`` candidates, sent ``after`` Ranks of 20 that the
    stage answered (and learnt how long its calls take from)."""
    with grpc.insecure_channel(server.address) as channel:
        rank = ranking_pb2_grpc.RankingServiceStub(channel).Rank
        for _ in range(after):
            rank(rank_request(world, 20), timeout=10)
    return health_while_held(server, core.gate, lambda ch: ranking_pb2_grpc.RankingServiceStub(ch).Rank.future(
        rank_request(world, rows), timeout=30))


def assert_prompt(took: list[float]) -> None:
    # Every check answered within the probe deadline (asserted as it was made); typically in about a
    # millisecond, so a median of 100 ms leaves a wide margin for a loaded machine.
    assert len(took) == CHECKS and statistics.median(took) < 0.1, took


def loop_thread(servers: ServerThread) -> str:
    """The name of the thread the servers' event loop runs on."""

    async def name() -> str:
        return threading.current_thread().name

    return servers.run(name())


def ranking_server(servers: ServerThread) -> tuple[StageServer, HeldRankingCore, ToyWorld]:
    world = ToyWorld()
    core = HeldRankingCore(world)
    return servers.start(RankingStage(lambda: core)), core, world


def test_health_answers_while_the_first_core_call_is_held(servers: ServerThread) -> None:
    server, core, world = ranking_server(servers)
    try:
        took = health_while_rank_held(server, core, world, rows=20)
    finally:
        servers.stop(server)
    assert_prompt(took)
    assert core.gate.threads[0].startswith("ranking.Rank-core")  # no estimate yet: the batcher's thread


def test_short_calls_run_inline_and_a_call_larger_than_any_before_on_the_thread(servers: ServerThread) -> None:
    server, core, world = ranking_server(servers)
    try:
        took = health_while_rank_held(server, core, world, rows=400, after=5)
    finally:
        servers.stop(server)
    assert_prompt(took)
    assert core.gate.threads[1:5] == [loop_thread(servers)] * 4, core.gate.threads  # predicted short: inline
    assert core.gate.threads[5].startswith("ranking.Rank-core")  # 400 rows, never seen: the thread


def test_health_answers_while_a_call_predicted_long_is_held(servers: ServerThread) -> None:
    server, core, world = ranking_server(servers)
    core.delay_s = 2 * INLINE_MAX_S  # every call is long: the stage learns it
    try:
        took = health_while_rank_held(server, core, world, rows=20, after=3)
    finally:
        servers.stop(server)
    assert_prompt(took)
    assert all(t.startswith("ranking.Rank-core") for t in core.gate.threads), core.gate.threads


def test_health_answers_while_an_unbatched_call_is_held(servers: ServerThread) -> None:
    """AugmentUser is not batched: the stage runs it directly, by the same rule."""
    core = HeldFeatureCore(ToyWorld())
    server = servers.start(FeatureStage(lambda: core))
    try:
        took = health_while_held(server, core.gate, lambda ch: features_pb2_grpc.FeatureServiceStub(ch).AugmentUser.future(
            features_pb2.AugmentUserRequest(user_id=3), timeout=30))
        # The held call taught the stage that a call takes as long as it was held (10 health checks:
        # over INLINE_MAX_S on a slow machine), so the calls after it go to the thread until the
        # average has come back down: then they run inline. 40 calls cover a hold of seconds.
        with grpc.insecure_channel(server.address) as channel:
            for _ in range(40):
                reply: Any = features_pb2_grpc.FeatureServiceStub(channel).AugmentUser(
                    features_pb2.AugmentUserRequest(user_id=4), timeout=10)
                assert reply.user_id == 4
                if core.gate.threads[-1] == loop_thread(servers):
                    break
    finally:
        servers.stop(server)
    assert_prompt(took)
    assert core.gate.threads[0].startswith("core")  # the first call: on a thread
    after = core.gate.threads[1:]
    assert after[-1] == loop_thread(servers), after  # short ones after it: inline, once the hold wore off
    assert all(t.startswith("core") for t in after[:-1]), after  # before that: on the thread
