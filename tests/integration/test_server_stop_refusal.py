"""A stopping server refuses the calls that reach it UNAVAILABLE while the ones in flight finish, and
only then lets gRPC's server stop: gRPC cancels the calls that had reached a server but that no handler
had taken up when its stop began (grpc/grpc#10418), and CANCELLED tells the client it cancelled the
call itself. Seen with ``recpipe serve`` stopped under 8 clients: 1-3 of their calls CANCELLED in 2 of
5 stops. Real in-process servers over toy cores; the gateway's own event loop is held while the calls
arrive, with its stop queued behind, so they are pending when it stops, as calls that came a few
milliseconds before the SIGTERM were."""

from __future__ import annotations

import grpc
from test_gateway_readiness import outcomes_while_stopping, wait_status
from toy_stages import ToyFeatureCore, ToyRankingCore, ToyRetrievalCore, ToyWorld

from recpipe.features.servicer import FeatureStage
from recpipe.gateway.servicer import GatewayStage
from recpipe.ranking.servicer import RankingStage
from recpipe.retrieval.servicer import RetrievalStage
from recpipe.serving.server import ServerThread


def test_calls_reaching_a_stopping_gateway_are_refused_unavailable_never_cancelled() -> None:
    world = ToyWorld()
    with ServerThread() as st, ServerThread() as gateway_thread:
        features = st.start(FeatureStage(lambda: ToyFeatureCore(world)))
        retrieval = st.start(RetrievalStage(lambda: ToyRetrievalCore(world)))
        ranking = st.start(RankingStage(lambda: ToyRankingCore(world)))
        gateway = gateway_thread.start(GatewayStage(features.address, retrieval.address, ranking.address))
        wait_status(gateway.address, "SERVING")
        outcomes = outcomes_while_stopping(gateway.address, gateway_thread, gateway, 2.0, calls=8)
    codes = [code for code, _ in outcomes]
    assert grpc.StatusCode.CANCELLED not in codes, outcomes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, outcomes
    for code, details in outcomes:
        if code == grpc.StatusCode.UNAVAILABLE:
            assert "stopping" in details and len(details) < 1000, details
