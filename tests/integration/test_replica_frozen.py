"""A frozen replica (SIGSTOP, a hung event loop: its connection stays up) is passed over by the
gateway's hops once its health check goes unanswered, and used again once it answers. Before, the
hops passed over it only while a batch of theirs was out on it: as soon as that batch had waited out
its deadline the next went there. Measured with ``recpipe serve --replicas ranking=2,features=2
--unresponsive-timeout 0``, ranking#1 SIGSTOPped for 10 s under 100 q/s with 1 s deadlines: 11 queries
DEADLINE_EXCEEDED, about one a second; 2 after. Real in-process servers over toy cores; the frozen
replica's own event loop is held, as SIGSTOP would hold its process."""

from __future__ import annotations

import time

import grpc
from test_gateway_readiness import recommend_outcome, wait_status
from toy_stages import ToyFeatureCore, ToyRankingCore, ToyRetrievalCore, ToyWorld

from recpipe.features.servicer import FeatureStage
from recpipe.gateway.clients import GrpcRankingClient
from recpipe.gateway.servicer import GatewayStage
from recpipe.ranking.servicer import RankingStage
from recpipe.retrieval.servicer import RetrievalStage
from recpipe.serving.server import ServerThread
from recpipe.v1 import recommend_pb2_grpc


def test_a_frozen_replica_is_passed_over_until_it_answers_again() -> None:
    world = ToyWorld()
    with ServerThread() as st, ServerThread() as frozen_thread:
        frozen = frozen_thread.start(RankingStage(lambda: ToyRankingCore(world)))
        other = st.start(RankingStage(lambda: ToyRankingCore(world)))
        features = st.start(FeatureStage(lambda: ToyFeatureCore(world)))
        retrieval = st.start(RetrievalStage(lambda: ToyRetrievalCore(world)))
        stage = GatewayStage(features.address, retrieval.address, f"ipv4:{frozen.address},{other.address}")
        gateway = st.start(stage)
        wait_status(gateway.address, "SERVING")
        assert isinstance(stage.chain.ranking, GrpcRankingClient)  # type: ignore[union-attr]
        rank = stage.chain.ranking.hops["Rank"]  # type: ignore[union-attr]
        with grpc.insecure_channel(gateway.address) as channel:
            stub = recommend_pb2_grpc.RecommendServiceStub(channel)

            def recommend() -> str:
                return recommend_outcome(stub, 1, timeout=0.4)[0].name

            while not rank.sent_per_route[0]:  # a lone query's batch goes to the first replica
                assert recommend() == "OK"
            frozen_thread.loop.call_soon_threadsafe(time.sleep, 4.0)
            until = time.monotonic() + 3.5
            outcomes = []
            while time.monotonic() < until:
                outcomes.append(recommend())
            # the calls on it until its health check has gone unanswered (TIMEOUT_S, 1 s) fail; the rest
            # go to the other replica
            assert outcomes.count("DEADLINE_EXCEEDED") <= 4 and outcomes.count("OK") >= 20, outcomes
            assert set(outcomes) <= {"OK", "DEADLINE_EXCEEDED"}, outcomes
            # thawed, it answers its checks and takes the batches again
            time.sleep(0.6)
            sent = rank.sent_per_route[0]
            deadline = time.monotonic() + 5
            while rank.sent_per_route[0] == sent:
                assert recommend() == "OK"
                assert time.monotonic() < deadline, rank.sent_per_route
        st.stop(gateway)
