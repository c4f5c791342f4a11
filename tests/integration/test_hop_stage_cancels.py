"""A stage that cancels the gateway's call is a stage gone, not a caller who cancelled: the gateway
answers UNAVAILABLE naming the stage, as for any stage down, so the client may retry elsewhere. gRPC
cancels the calls that reached a server but were not yet taken up when its shutdown began
(grpc/grpc#10418): the gateway passed that on as CANCELLED, telling the client it had cancelled, and
logged and counted it as "cancelled by the caller". Seen with ``recpipe serve --replicas
features=2``: SIGTERM to one features replica under 100 q/s, one query failed CANCELLED "features:
CANCELLED". Real in-process servers over toy cores; the stage's own event loop held while the calls
arrive, so they are still pending when it stops."""

from __future__ import annotations

import grpc
from test_gateway_readiness import outcomes_while_stopping, wait_status
from toy_stages import ToyFeatureCore, ToyRankingCore, ToyRetrievalCore, ToyWorld

from recpipe.features.servicer import FeatureStage
from recpipe.gateway.options import GatewayOptions
from recpipe.gateway.servicer import GatewayStage
from recpipe.ranking.servicer import RankingStage
from recpipe.retrieval.servicer import RetrievalStage
from recpipe.serving.server import ServerThread


def test_calls_a_stopping_stage_cancels_are_unavailable_naming_it_not_cancelled() -> None:
    world = ToyWorld()
    # one RPC per stage call (no batching, no stream): several calls reach the stage at once
    options = GatewayOptions(hop_transport="rpc", hop_max_batch=1)
    with ServerThread() as st, ServerThread() as stage_thread:
        features = stage_thread.start(FeatureStage(lambda: ToyFeatureCore(world)))
        retrieval = st.start(RetrievalStage(lambda: ToyRetrievalCore(world)))
        ranking = st.start(RankingStage(lambda: ToyRankingCore(world)))
        gateway = st.start(GatewayStage(features.address, retrieval.address, ranking.address, options))
        wait_status(gateway.address, "SERVING")
        # the features stage's loop is busy for 1 s, its stop queued behind: the calls arriving
        # meanwhile are still pending when it stops
        outcomes = outcomes_while_stopping(gateway.address, stage_thread, features, 1.0, calls=6)
        st.stop(gateway)
    failed = [(code, details) for code, details in outcomes if code != grpc.StatusCode.OK]
    assert failed, outcomes
    for code, details in failed:
        assert code == grpc.StatusCode.UNAVAILABLE, outcomes
        assert details.startswith(f"features unavailable at {features.address}: "), details
        assert len(details) < 1000, details
