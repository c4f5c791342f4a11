"""The gateway's health is the chain's readiness, on real in-process gRPC servers over toy cores: NOT_SERVING
until every stage it calls is SERVING, NOT_SERVING again when one stops or is not loaded, SERVING again
when it is back; Recommend meanwhile answers UNAVAILABLE naming the stage."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from toy_stages import ToyFeatureCore, ToyRankingCore, ToyRetrievalCore, ToyWorld

from recpipe.client import RecommendClient
from recpipe.errors import StageUnavailable
from recpipe.features.servicer import FeatureStage
from recpipe.gateway.servicer import GatewayStage
from recpipe.ranking.servicer import RankingStage
from recpipe.retrieval.servicer import RetrievalStage
from recpipe.serving.server import ServerThread, StageServer
from recpipe.serving.supervisor import free_port, health_status
from recpipe.v1 import recommend_pb2, recommend_pb2_grpc


def wait_status(address: str, wanted: str, timeout: float = 10.0) -> float:
    """Seconds until the server at ``address`` reports ``wanted``; fails after ``timeout``."""
    start = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        while True:
            status = health_status(channel)
            if status == wanted:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                pytest.fail(f"{address} still {status} after {timeout}s (wanted {wanted})")
            time.sleep(0.02)


def recommend_outcome(stub: recommend_pb2_grpc.RecommendServiceStub, user: int, timeout: float = 10.0
                      ) -> tuple[grpc.StatusCode, str]:
    """A Recommend of 20 candidates for ``user``: its status code and details (OK, "" when answered)."""
    try:
        stub.Recommend(recommend_pb2.RecommendRequest(user_id=user, num_candidates=20, num_results=5), timeout=timeout)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""



def outcomes_while_stopping(gateway: str, held: ServerThread, server: StageServer, grace_s: float, calls: int
                            ) -> list[tuple[grpc.StatusCode, str]]:
    """The outcomes (``recommend_outcome``) of ``calls`` concurrent Recommends sent to ``gateway`` while
    ``server`` stops: after one answered query, ``held``'s event loop (``server``'s) sleeps 1 s with the
    stop (``grace_s``) queued behind it, so the calls reach a server that is about to stop and are still
    pending when it does."""
    with grpc.insecure_channel(gateway) as channel:
        stub = recommend_pb2_grpc.RecommendServiceStub(channel)
        assert recommend_outcome(stub, 0)[0] == grpc.StatusCode.OK
        held.loop.call_soon_threadsafe(time.sleep, 1.0)
        stopping = asyncio.run_coroutine_threadsafe(server.stop(grace_s), held.loop)
        with ThreadPoolExecutor(calls) as pool:
            outcomes = list(pool.map(lambda user: recommend_outcome(stub, user), range(1, calls + 1)))
        stopping.result(10)
    return outcomes

@contextlib.contextmanager
def toy_features_chain() -> Iterator[tuple[subprocess.Popen[bytes], str, str]]:
    """A gateway whose features stage runs in a process of its own (``toy_serve.py``), so that a test can
    freeze or kill it, and retrieval and ranking in this one: (that process, its address, the gateway's),
    once the gateway is SERVING and has answered a Recommend."""
    port = free_port()
    toy = subprocess.Popen([sys.executable, str(Path(__file__).with_name("toy_serve.py")), str(port)])
    world = ToyWorld()
    try:
        wait_status(f"127.0.0.1:{port}", "SERVING", timeout=60)
        with ServerThread() as st:
            retrieval = st.start(RetrievalStage(lambda: ToyRetrievalCore(world)))
            ranking = st.start(RankingStage(lambda: ToyRankingCore(world)))
            gateway = st.start(GatewayStage(f"127.0.0.1:{port}", retrieval.address, ranking.address))
            wait_status(gateway.address, "SERVING")
            with RecommendClient(gateway.address, timeout=30) as client:
                assert len(client.recommend(1, 20, 5).item_ids) == 5
            yield toy, f"127.0.0.1:{port}", gateway.address
    finally:
        if toy.poll() is None:
            toy.terminate()
        toy.wait(timeout=30)


def test_gateway_health_follows_every_stage_it_calls():
    world = ToyWorld()
    ports = {name: free_port() for name in ("features", "retrieval", "ranking")}
    stages = {
        "features": lambda: FeatureStage(lambda: ToyFeatureCore(world)),
        "retrieval": lambda: RetrievalStage(lambda: ToyRetrievalCore(world)),
        "ranking": lambda: RankingStage(lambda: ToyRankingCore(world)),
    }
    with ServerThread() as st:
        gateway = st.start(GatewayStage(*(f"127.0.0.1:{ports[n]}" for n in ("features", "retrieval", "ranking"))))
        client = RecommendClient(gateway.address)
        try:
            # No stage yet: the gateway answers, NOT_SERVING, and Recommend names the missing stage.
            time.sleep(0.5)
            with grpc.insecure_channel(gateway.address) as channel:
                assert health_status(channel) == "NOT_SERVING"
            with pytest.raises(StageUnavailable, match=r"(features|retrieval) unavailable at"):
                client.recommend(1, 20, 5)

            servers = {name: st.start(stages[name](), port=ports[name]) for name in ("features", "retrieval")}
            # ranking is up but still loading (its own health NOT_SERVING): the chain is not ready
            servers["ranking"] = st.start(stages["ranking"](), port=ports["ranking"], load=False)
            with grpc.insecure_channel(gateway.address) as channel:
                assert health_status(channel) == "NOT_SERVING"
            # once the gateway's channels to the new stages are past their reconnect backoff, the call
            # reaches ranking, which says why it cannot answer yet
            deadline = time.monotonic() + 20
            while True:
                with pytest.raises(StageUnavailable) as refused:
                    client.recommend(1, 20, 5)
                # "ranking unavailable at ...: Failed to connect" is the backoff itself: keep waiting
                if "still loading" in str(refused.value) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert re.search(r"ranking unavailable at .*still loading", str(refused.value)), refused.value

            st.run(servers["ranking"].load())
            wait_status(gateway.address, "SERVING")
            assert len(client.recommend(1, 20, 5).item_ids) == 5  # the first SERVING is a working chain

            # A stage goes away: NOT_SERVING promptly, and back to SERVING once it is back.
            st.stop(servers["ranking"], grace=0)
            assert wait_status(gateway.address, "NOT_SERVING", timeout=5) < 2.0
            with pytest.raises(StageUnavailable, match="ranking unavailable at"):
                client.recommend(1, 20, 5)
            servers["ranking"] = st.start(stages["ranking"](), port=ports["ranking"])
            wait_status(gateway.address, "SERVING")
            assert len(client.recommend(2, 20, 5).item_ids) == 5
        finally:
            client.close()


def test_a_frozen_stage_fails_fast_instead_of_costing_each_call_its_deadline():
    """A stage that stops answering (SIGSTOP: its connection stays open, so calls just wait) is seen by the
    gateway's health checks within about a second; from then on calls that need it are refused with
    UNAVAILABLE naming it after the ride-through (``RIDE_THROUGH_S``, 1 s), instead of each waiting out
    its whole deadline as DEADLINE_EXCEEDED."""
    with toy_features_chain() as (toy, features, gateway), RecommendClient(gateway, timeout=30) as client:
        os.kill(toy.pid, signal.SIGSTOP)
        try:
            wait_status(gateway, "NOT_SERVING", timeout=10)  # the health checks noticed
            with grpc.insecure_channel(gateway) as channel:
                stub = recommend_pb2_grpc.RecommendServiceStub(channel)
                request = recommend_pb2.RecommendRequest(user_id=1, num_candidates=20)
                # short calls time out until the checks have missed SILENT_CHECKS answers in a row
                codes = []
                while not codes or codes[-1] != grpc.StatusCode.UNAVAILABLE:
                    assert len(codes) < 60, codes  # never: every call waits out its deadline
                    with pytest.raises(grpc.RpcError) as short:
                        stub.Recommend(request, timeout=0.5)
                    codes.append(short.value.code())
                assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
                with pytest.raises(grpc.RpcError) as refused:  # a long deadline is not waited out
                    started = time.monotonic()
                    stub.Recommend(request, timeout=30)
                assert time.monotonic() - started < 3.0
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert refused.value.details().startswith(f"features unavailable at {features}: no answer")
        finally:
            os.kill(toy.pid, signal.SIGCONT)
        wait_status(gateway, "SERVING")
        assert len(client.recommend(2, 20, 5).item_ids) == 5


def test_a_killed_stage_is_noticed_at_once_not_at_the_next_poll(monkeypatch: pytest.MonkeyPatch):
    """A stage killed outright closes its connection; the gateway checks at that moment instead of at its
    next poll, so it says NOT_SERVING even when a standby takes the port back faster than the poll (as
    the supervisor's standbys do). With the poll slowed to a minute only the connection watch can see it."""
    from recpipe.gateway import readiness

    with toy_features_chain() as (toy, _, gateway):
        monkeypatch.setattr(readiness, "INTERVAL_S", 60.0)
        time.sleep(2 * readiness.NOT_READY_INTERVAL_S + 0.5)  # the gateway is now in its minute-long wait
        os.kill(toy.pid, signal.SIGKILL)
        toy.wait(timeout=10)
        wait_status(gateway, "NOT_SERVING", timeout=10)


class Caller(threading.Thread):
    """Recommend calls one after another on one connection until halted, each outcome kept."""

    def __init__(self, target: str) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.outcomes: list[str] = []  # "OK" or the status code's name
        self.halt = threading.Event()

    def run(self) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = recommend_pb2_grpc.RecommendServiceStub(channel)
            while not self.halt.is_set():
                try:
                    stub.Recommend(recommend_pb2.RecommendRequest(user_id=1, num_candidates=20, num_results=5),
                                   timeout=10)
                    self.outcomes.append("OK")
                except grpc.RpcError as e:
                    self.outcomes.append(e.code().name)


def test_a_replica_killed_leaves_its_stage_serving_and_the_last_one_gone_does_not():
    """A stage run as two replicas is SERVING while either is: the hops pass over the one that is gone,
    so the gateway must neither say NOT_SERVING nor refuse calls for it. Each replica is checked on its
    own channel. Before, the check the connection watch starts at once went over the balanced channel,
    and could land on the killed replica before that channel had noticed: the gateway then refused
    every call until its next check (in test_replicas' chain of processes; not reproduced here)."""
    world = ToyWorld()
    port = free_port()
    toy = subprocess.Popen([sys.executable, str(Path(__file__).with_name("toy_serve.py")), str(port)])
    try:
        wait_status(f"127.0.0.1:{port}", "SERVING", timeout=60)
        with ServerThread() as st:
            other = st.start(FeatureStage(lambda: ToyFeatureCore(world)), port=free_port())
            retrieval = st.start(RetrievalStage(lambda: ToyRetrievalCore(world)))
            ranking = st.start(RankingStage(lambda: ToyRankingCore(world)))
            gateway = st.start(GatewayStage(f"ipv4:127.0.0.1:{port},{other.address}", retrieval.address,
                                            ranking.address))
            wait_status(gateway.address, "SERVING")
            with RecommendClient(gateway.address, timeout=30) as client, \
                    grpc.insecure_channel(gateway.address) as channel:
                caller = Caller(gateway.address)  # calls all along, as traffic would
                caller.start()
                while len(caller.outcomes) < 50:  # both replicas' channels connected and used
                    time.sleep(0.01)
                os.kill(toy.pid, signal.SIGKILL)
                killed = len(caller.outcomes)
                toy.wait(timeout=10)
                # the connection watch checks at once and the poll goes on: every check meanwhile finds
                # the chain serving on the other replica, and so does every call after the one (at most)
                # that was on the killed replica
                end = time.monotonic() + 1.5
                while time.monotonic() < end:
                    assert health_status(channel) == "SERVING"
                caller.halt.set()
                caller.join(30)
                after = caller.outcomes[killed:]
                assert len(after) >= 20 and after.count("OK") >= len(after) - 1, after
                st.stop(other, grace=0)
                assert wait_status(gateway.address, "NOT_SERVING", timeout=5) < 2.0
                with pytest.raises(StageUnavailable, match="features unavailable at"):
                    client.recommend(3, 20, 5)
    finally:
        if toy.poll() is None:
            toy.kill()
        toy.wait(timeout=30)


def test_a_replicated_stage_speaks_with_its_best_replica():
    """SERVING while any replica is; else an answer (NOT_SERVING: loading, not down), then no answer,
    then unreachable: the one ``down`` names."""
    from grpc import aio

    from recpipe.gateway.readiness import ChainReadiness

    world = ToyWorld()
    with ServerThread() as st:
        live = st.start(RankingStage(lambda: ToyRankingCore(world)))
        loading = st.start(RankingStage(lambda: ToyRankingCore(world)), load=False)
        dead = f"127.0.0.1:{free_port()}"

        async def check(*addresses: str) -> tuple[str, tuple[str, str] | None]:
            channels = [aio.insecure_channel(a) for a in addresses]
            try:
                readiness = ChainReadiness({"ranking": channels})

                async def report(ready: bool) -> None:
                    pass

                await readiness.check_once(report)
                return readiness.status["ranking"], readiness.down()
            finally:
                for channel in channels:
                    await channel.close()

        assert st.run(check(dead, live.address)) == ("SERVING", None)
        assert st.run(check(loading.address, dead)) == ("NOT_SERVING", None)
        status, down = st.run(check(dead, dead))
        assert status.startswith("UNAVAILABLE") and down == ("ranking", status)


def test_a_query_rides_through_a_stage_restart_instead_of_failing():
    """A stage killed and back within ``RIDE_THROUGH_S`` (a warm standby takes the port in 0.3-0.5 s)
    costs the queries of those moments time, not answers: they wait for the health checks to see it
    back, and one whose stage went down under it runs once more. Before, each was refused UNAVAILABLE at
    once (one ranking process killed twice under 100 q/s: 108 of 2,400 queries). A stage down for
    longer still fails the query UNAVAILABLE, before its deadline."""
    world = ToyWorld()
    port = free_port()
    with ServerThread() as st:
        features = st.start(FeatureStage(lambda: ToyFeatureCore(world)))
        retrieval = st.start(RetrievalStage(lambda: ToyRetrievalCore(world)))
        ranking = st.start(RankingStage(lambda: ToyRankingCore(world)), port=port)
        gateway = st.start(GatewayStage(features.address, retrieval.address, f"127.0.0.1:{port}"))
        wait_status(gateway.address, "SERVING")
        with RecommendClient(gateway.address, timeout=5) as client:
            assert len(client.recommend(1, 20, 5).item_ids) == 5
            st.stop(ranking, grace=0)
            assert wait_status(gateway.address, "NOT_SERVING", timeout=5) < 2.0
            back = threading.Timer(0.3, lambda: st.start(RankingStage(lambda: ToyRankingCore(world)), port=port))
            back.start()
            start = time.monotonic()
            assert len(client.recommend(2, 20, 5).item_ids) == 5  # waited for ranking instead of failing
            assert time.monotonic() - start < 2.0
            back.join()
            st.stop(st.servers[-1], grace=0)  # down for good: refused after the ride-through, not the deadline
            wait_status(gateway.address, "NOT_SERVING", timeout=5)
            start = time.monotonic()
            with pytest.raises(StageUnavailable, match="ranking unavailable at"):
                client.recommend(3, 20, 5)
            assert 0.5 < time.monotonic() - start < 2.5
