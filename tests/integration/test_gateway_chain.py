"""The Recommend gateway on real in-process gRPC stage servers over toy numpy cores: ordering,
timings, the contract's argument checks, deadlines propagated to every hop, a stage that is down."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from toy_stages import ToyFeatureCore, ToyRankingCore, ToyRetrievalCore, ToyWorld

from recpipe.config import STEPS, TOTAL_STEP
from recpipe.features.servicer import FeatureStage
from recpipe.gateway.chain import top_n
from recpipe.gateway.servicer import GatewayStage
from recpipe.ranking.servicer import RankingStage
from recpipe.retrieval.servicer import RetrievalStage
from recpipe.serving.server import ServerThread
from recpipe.serving.supervisor import free_port
from recpipe.v1 import recommend_pb2, recommend_pb2_grpc


class RecordingFeatureStage(FeatureStage):
    """The real feature servicer, recording the time left of each AugmentUser request it works on, however
    it came (a unary call's deadline, a batch or stream entry's ``timeout_us``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.remaining: list[float | None] = []

    def _decoded(self, method, core, request, deadline):
        if method.name == "AugmentUser":
            self.remaining.append(None if deadline is None else deadline - time.monotonic())
        return super()._decoded(method, core, request, deadline)


@pytest.fixture(scope="module")
def toy_chain():
    world = ToyWorld()
    cores = {"features": ToyFeatureCore(world), "retrieval": ToyRetrievalCore(world), "ranking": ToyRankingCore(world)}
    with ServerThread() as st:
        features = RecordingFeatureStage(lambda: cores["features"])
        f = st.start(features)
        r = st.start(RetrievalStage(lambda: cores["retrieval"]))
        k = st.start(RankingStage(lambda: cores["ranking"], workers=1))
        g = st.start(GatewayStage(f.address, r.address, k.address))
        channel = grpc.insecure_channel(g.address)
        yield {
            "stub": recommend_pb2_grpc.RecommendServiceStub(channel),
            "cores": cores,
            "world": world,
            "servers": st,
            "features": features,
            "addresses": {"features": f.address, "retrieval": r.address, "ranking": k.address},
        }
        channel.close()


def recommend(stub, user_id=3, k=0, n=0, timeout=10.0):
    return stub.Recommend(
        recommend_pb2.RecommendRequest(user_id=user_id, num_candidates=k, num_results=n), timeout=timeout
    )


def test_recommend_ranks_the_retrieved_candidates(toy_chain):
    world = toy_chain["world"]
    reply = recommend(toy_chain["stub"], user_id=7, k=50, n=8)
    ids = np.array(reply.item_ids)
    scores = np.array(reply.scores, dtype=np.float32)
    assert len(ids) == 8 and len(set(ids.tolist())) == 8
    assert np.all(np.diff(scores) <= 0)
    # The same computation done by hand: exact top-50 by inner product, then the toy ranker's score.
    sims = world.item_emb @ world.user_dense[7]
    cand = np.argsort(-sims)[:50]
    logits = world.item_dense[cand].sum(1) + world.item_emb[cand] @ world.user_dense[7] + 0.01 * world.user_dense[7].sum()
    expected = cand[np.argsort(-logits)[:8]]
    assert set(ids.tolist()) == set(expected.tolist())
    assert reply.model_version == "toy-1"


def test_timings_cover_every_stage_and_total(toy_chain):
    reply = recommend(toy_chain["stub"], k=20, n=5)
    timings = {t.stage: t for t in reply.timings}
    assert list(timings) == [*STEPS, TOTAL_STEP]
    for stage in STEPS:
        assert 0 < timings[stage].server_us <= timings[stage].observed_us
    assert timings[TOTAL_STEP].observed_us >= sum(timings[s].observed_us for s in STEPS)


def test_defaults(toy_chain):
    reply = recommend(toy_chain["stub"])
    assert len(reply.item_ids) == 10  # num_results 0 -> 10 (candidates: the whole 400-item toy catalogue)


@pytest.mark.parametrize(
    ("k", "n", "message"),
    [
        (-1, 0, "num_candidates must be >= 0"),
        (401, 0, "item count 400"),
        (10_001, 0, "<= 10000"),
        (5, 6, "num_results (6) must be <= num_candidates (5)"),
        (5, -1, "num_results must be >= 0"),
    ],
)
def test_bad_sizes_are_invalid_argument(toy_chain, k, n, message):
    with pytest.raises(grpc.RpcError) as info:
        recommend(toy_chain["stub"], k=k, n=n)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_unknown_user_is_not_found(toy_chain):
    with pytest.raises(grpc.RpcError) as info:
        recommend(toy_chain["stub"], user_id=10_000)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "10000" in info.value.details()


def test_deadline_is_propagated_to_the_stages(toy_chain):
    features = toy_chain["features"]
    features.remaining.clear()
    toy_chain["stub"].Recommend(recommend_pb2.RecommendRequest(user_id=3))  # no deadline: none passed on
    recommend(toy_chain["stub"], timeout=3.0)
    assert features.remaining[0] is None
    # gRPC rounds the deadline it puts on the wire up a little.
    assert features.remaining[1] is not None and 0 < features.remaining[1] <= 3.1


def test_deadline_passing_is_deadline_exceeded(toy_chain):
    ranking = toy_chain["cores"]["ranking"]
    ranking.delay_s = 0.5
    try:
        with pytest.raises(grpc.RpcError) as info:
            recommend(toy_chain["stub"], k=20, n=5, timeout=0.25)
    finally:
        ranking.delay_s = 0.0
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(recommend(toy_chain["stub"], k=20, n=5).item_ids) == 5  # and it keeps serving


@pytest.mark.parametrize("down", ["features", "retrieval", "ranking"])
def test_stage_down_is_unavailable_naming_it(toy_chain, down):
    targets = dict(toy_chain["addresses"])
    targets[down] = f"127.0.0.1:{free_port()}"  # nothing listens there
    st = toy_chain["servers"]
    gateway = st.start(GatewayStage(targets["features"], targets["retrieval"], targets["ranking"]))
    try:
        with grpc.insecure_channel(gateway.address) as channel:
            stub = recommend_pb2_grpc.RecommendServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                recommend(stub, k=20, n=5, timeout=5)
    finally:
        st.stop(gateway)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details().startswith(f"{down} unavailable at {targets[down]}")


def test_top_n_orders_and_cuts():
    ids = np.array([10, 11, 12, 13, 14], dtype=np.int64)
    scores = np.array([0.1, 0.9, 0.5, 0.7, 0.3], dtype=np.float32)
    top_ids, top_scores = top_n(ids, scores, 3)
    assert top_ids.tolist() == [11, 13, 12]
    assert top_scores.tolist() == pytest.approx([0.9, 0.7, 0.5])
    assert top_n(ids, scores, 10)[0].tolist() == [11, 13, 12, 14, 10]


def test_gateway_sends_lone_queries_to_the_first_replica_and_passes_over_one_that_stops(toy_chain):
    """A target listing several replicas (``recpipe serve --replicas``): the gateway opens a channel to
    each; lone queries meet the first (warm) replica, and one that stops is passed over."""
    world, st = toy_chain["world"], toy_chain["servers"]
    seen = {"a": 0, "b": 0}

    def counting(key):
        core = ToyFeatureCore(world)
        user, items = core.user_features, core.items_batch

        def user_features(query):
            seen[key] += 1
            return user(query)

        def items_batch(queries):
            seen[key] += len(queries)
            return items(queries)

        core.user_features = user_features  # type: ignore[method-assign]
        core.items_batch = items_batch  # type: ignore[method-assign]
        return core

    a = st.start(FeatureStage(lambda: counting("a")))
    b = st.start(FeatureStage(lambda: counting("b")))
    addresses = toy_chain["addresses"]
    gateway = st.start(GatewayStage(f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}", addresses["retrieval"],
                                    addresses["ranking"]))
    running = [gateway, b, a]
    try:
        with grpc.insecure_channel(gateway.address) as channel:
            stub = recommend_pb2_grpc.RecommendServiceStub(channel)
            for _ in range(10):
                recommend(stub, k=20, n=5)
            assert seen == {"a": 20, "b": 0}  # both calls of each query, all on the first replica
            st.stop(running.pop())
            deadline = time.monotonic() + 5.0
            while True:  # a call already on its way when the replica went may fail; later ones may not
                try:
                    recommend(stub, k=20, n=5)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "the gateway kept calling the stopped replica"
                    time.sleep(0.05)
            before = seen["b"]
            for _ in range(10):
                recommend(stub, k=20, n=5)
            assert seen["b"] == before + 20 and seen["a"] == 20
    finally:
        for server in running:
            st.stop(server)


def test_the_first_call_after_serving_meets_replicas_that_bound_after_the_gateway(toy_chain):
    """Replicas load before they take their ports, so a gateway's channels to them start failing and
    back off; once the gateway says SERVING (its readiness checks reached a replica on that replica's own
    channel, the one its hops send on), the first Recommend must be answered."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    world, st = toy_chain["world"], toy_chain["servers"]
    ports = [free_port(), free_port()]
    addresses = toy_chain["addresses"]
    gateway = st.start(GatewayStage(f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", addresses["retrieval"],
                                    addresses["ranking"]))
    running = [gateway]
    try:
        time.sleep(0.3)  # the gateway's channels to the replicas have failed to connect and back off
        running += [st.start(FeatureStage(lambda: ToyFeatureCore(world)), port=p) for p in ports]
        with grpc.insecure_channel(gateway.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 10
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "the gateway never became SERVING"
                time.sleep(0.01)
            stub = recommend_pb2_grpc.RecommendServiceStub(channel)
            for _ in range(5):
                assert len(recommend(stub, k=20, n=5).item_ids) == 5
    finally:
        for server in reversed(running):
            st.stop(server)
