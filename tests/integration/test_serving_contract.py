"""The Recommend contract on the real chain (real feature, retrieval and ranking cores over the shared
tiny dataset and model repository, real gRPC servers on free ports): answers, defaults, every error
path, malformed tensors sent straight to each stage, health and reflection on every server."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from recpipe import schema
from recpipe.client import RecommendClient
from recpipe.config import MAX_NUM_CANDIDATES, STEPS, TOTAL_STEP
from recpipe.errors import BadRequest, DeadlineExceeded, StageUnavailable, UnknownUser
from recpipe.gateway.servicer import GatewayStage
from recpipe.serving import codec
from recpipe.serving.supervisor import free_port
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


@pytest.fixture(scope="module")
def client(serving_chain):
    with RecommendClient(serving_chain.gateway.address) as c:
        yield c


def test_recommend_returns_distinct_valid_items_descending(client, dataset_info):
    for user in (0, 1, dataset_info["num_users"] - 1):
        rec = client.recommend(user, num_candidates=200, num_results=25)
        ids = rec.item_ids.tolist()
        assert len(ids) == 25 and len(set(ids)) == 25
        assert all(0 <= i < dataset_info["num_items"] for i in ids)
        assert np.all(np.diff(rec.scores) <= 0)
        assert np.all((rec.scores >= 0) & (rec.scores <= 1))
        assert rec.model_version
        assert [t.stage for t in rec.timings] == [*STEPS, TOTAL_STEP]
        for stage in STEPS:
            t = rec.timing(stage)
            assert 0 < t.server_us <= t.observed_us
        assert rec.timing(TOTAL_STEP).observed_us >= sum(rec.timing(s).observed_us for s in STEPS)


def test_defaults_are_500_candidates_and_10_results(client):
    assert len(client.recommend(5).item_ids) == 10
    assert len(client.recommend(5, 0, 500).item_ids) == 500  # 500 results fit in the default candidates
    with pytest.raises(BadRequest, match=r"num_results \(501\) must be <= num_candidates \(500\)"):
        client.recommend(5, 0, 501)


def test_same_query_same_answer(client):
    a, b = client.recommend(3, 300, 10), client.recommend(3, 300, 10)
    assert a.item_ids.tolist() == b.item_ids.tolist()


@pytest.mark.parametrize("user", [-1, 10**9])
def test_unknown_user_is_not_found(serving_chain, user):
    with grpc.insecure_channel(serving_chain.gateway.address) as channel, pytest.raises(grpc.RpcError) as info:
        recommend_pb2_grpc.RecommendServiceStub(channel).Recommend(
            recommend_pb2.RecommendRequest(user_id=user), timeout=10
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert str(user) in info.value.details()


def test_client_raises_unknown_user(client):
    with pytest.raises(UnknownUser):
        client.recommend(10**9)


def test_bad_sizes_are_invalid_argument(serving_chain, dataset_info):
    items = dataset_info["num_items"]
    assert items < MAX_NUM_CANDIDATES  # the tiny dataset: both ceilings are reachable below
    cases = [(-1, 0), (items + 1, 0), (MAX_NUM_CANDIDATES + 1, 0), (20, 21), (0, -3)]
    with grpc.insecure_channel(serving_chain.gateway.address) as channel:
        stub = recommend_pb2_grpc.RecommendServiceStub(channel)
        for k, n in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.Recommend(recommend_pb2.RecommendRequest(user_id=1, num_candidates=k, num_results=n), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (k, n)
        assert len(stub.Recommend(recommend_pb2.RecommendRequest(user_id=1, num_candidates=items), timeout=30).item_ids) == 10


def serving_chain_items(serving_chain) -> int:
    with grpc.insecure_channel(serving_chain.retrieval.address) as channel:
        info = info_pb2_grpc.InfoServiceStub(channel).GetInfo(info_pb2.GetInfoRequest(), timeout=10)
    return int(info.details["num_items"])


def _user_features(serving_chain):
    with grpc.insecure_channel(serving_chain.features.address) as channel:
        return features_pb2_grpc.FeatureServiceStub(channel).AugmentUser(
            features_pb2.AugmentUserRequest(user_id=2), timeout=10
        )


def _short(t):
    return type(t)(dtype=t.dtype, shape=list(t.shape), data=t.data[:-1])


def _as(t, dtype):
    return codec.encode(codec.decode(t, "t", t.dtype).astype(dtype))


def _reshape(t, shape):
    return codec.encode(codec.decode(t, "t", t.dtype).reshape(shape))


def test_malformed_tensors_to_features_are_invalid_argument(serving_chain):
    ids = codec.encode(np.arange(10, dtype=np.int64))
    bad = {
        "byte length": _short(ids),
        "dtype": _as(ids, np.int32),
        "shape": _reshape(ids, (2, 5)),
        "id out of range": codec.encode(np.array([0, 10**9], dtype=np.int64)),
    }
    with grpc.insecure_channel(serving_chain.features.address) as channel:
        stub = features_pb2_grpc.FeatureServiceStub(channel)
        for what, tensor in bad.items():
            with pytest.raises(grpc.RpcError) as info:
                stub.AugmentItems(features_pb2.AugmentItemsRequest(user_id=2, item_ids=tensor), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert "item" in info.value.details(), what
        reply = stub.AugmentItems(features_pb2.AugmentItemsRequest(user_id=2, item_ids=ids), timeout=10)
        # the ids travel as int32 (every id fits): half the bytes of int64; stages take either
        assert codec.decode(reply.sparse, "sparse", "int32").shape == (10, len(schema.ITEM_CATEGORICAL))


def test_malformed_tensors_to_retrieval_are_invalid_argument(serving_chain):
    user = _user_features(serving_chain)
    good = {"user_dense": user.dense, "user_sparse": user.sparse, "recent_items": user.recent_items}
    bad = [
        ("user_dense", _short(user.dense)),
        ("user_dense", _as(user.dense, np.float64)),
        ("user_dense", _reshape(user.dense, (1, -1))),
        ("user_sparse", _short(user.sparse)),
        ("user_sparse", _as(user.sparse, np.float32)),
    ]
    with grpc.insecure_channel(serving_chain.retrieval.address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        for field, tensor in bad:
            request = retrieval_pb2.RetrieveRequest(**{**good, field: tensor}, k=20)
            with pytest.raises(grpc.RpcError) as info:
                stub.Retrieve(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in info.value.details()
        for k, extra in ((-5, {}), (20, {"nprobe": -1})):
            with pytest.raises(grpc.RpcError) as info:
                stub.Retrieve(retrieval_pb2.RetrieveRequest(**good, k=k, **extra), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        reply = stub.Retrieve(retrieval_pb2.RetrieveRequest(**good, k=20), timeout=10)
        found = codec.decode(reply.item_ids, "item_ids", "int64", (20,))
        assert len(set(found.tolist())) == 20
        # recent_items is not read (the two-tower model does not use history), so even a malformed one
        # changes nothing; k 0 is the stage's default (500 or the whole catalogue)
        odd = retrieval_pb2.RetrieveRequest(**{**good, "recent_items": _reshape(user.recent_items, (1, -1))}, k=20)
        assert stub.Retrieve(odd, timeout=10).item_ids == reply.item_ids
        default = stub.Retrieve(retrieval_pb2.RetrieveRequest(**good), timeout=10)
        assert default.item_ids.shape[0] == min(500, serving_chain_items(serving_chain))


def test_malformed_tensors_to_ranking_are_invalid_argument(serving_chain):
    user = _user_features(serving_chain)
    with grpc.insecure_channel(serving_chain.features.address) as channel:
        items = features_pb2_grpc.FeatureServiceStub(channel).AugmentItems(
            features_pb2.AugmentItemsRequest(user_id=2, item_ids=codec.encode(np.arange(8, dtype=np.int64))), timeout=10
        )
    good = {"user_dense": user.dense, "user_sparse": user.sparse, "item_dense": items.dense, "item_sparse": items.sparse}
    bad = [
        ("user_dense", _short(user.dense)),
        ("item_dense", _as(items.dense, np.float16)),
        ("item_dense", _reshape(items.dense, (-1,))),
        ("item_sparse", _reshape(items.sparse, (4, -1))),  # k does not match item_dense
        ("item_sparse", _short(items.sparse)),
    ]
    with grpc.insecure_channel(serving_chain.ranking.address) as channel:
        stub = ranking_pb2_grpc.RankingServiceStub(channel)
        for field, tensor in bad:
            with pytest.raises(grpc.RpcError) as info:
                stub.Rank(ranking_pb2.RankRequest(**{**good, field: tensor}), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in info.value.details()
        reply = stub.Rank(ranking_pb2.RankRequest(**good), timeout=10)
        assert codec.decode(reply.scores, "scores", "float32").shape == (8,)


def test_chain_still_serves_after_bad_input(client):
    assert len(client.recommend(4, 50, 5).item_ids) == 5


def test_deadline_passed_is_deadline_exceeded(client):
    with pytest.raises(DeadlineExceeded):
        client.recommend(6, 500, 10, timeout=0.0005)
    assert len(client.recommend(6, 500, 10).item_ids) == 10


def test_stage_down_is_unavailable_naming_it(serving_chain, serving_threads):
    dead = f"127.0.0.1:{free_port()}"
    gateway = serving_threads.start(
        GatewayStage(serving_chain.features.address, serving_chain.retrieval.address, dead)
    )
    try:
        with RecommendClient(gateway.address) as c, pytest.raises(StageUnavailable, match=f"ranking unavailable at {dead}"):
            c.recommend(1, 50, 5)
    finally:
        serving_threads.stop(gateway)


def test_every_server_has_health_reflection_and_info(serving_chain):
    expected = {
        "gateway": "recpipe.v1.RecommendService",
        "features": "recpipe.v1.FeatureService",
        "retrieval": "recpipe.v1.RetrievalService",
        "ranking": "recpipe.v1.RankingService",
    }
    for stage, service in expected.items():
        address = serving_chain.targets[stage]
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert {service, "recpipe.v1.InfoService", "grpc.health.v1.Health"} <= services
        with RecommendClient(address) as c:
            info = c.info()
        assert info.stage == stage
        server = getattr(serving_chain, stage)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        assert f'recpipe_requests_total{{method="{service.removeprefix("recpipe.v1.")}/' in metrics
        assert "recpipe_request_latency_seconds_bucket" in metrics and "recpipe_in_flight_requests" in metrics
        if stage != "gateway":
            assert info.model_version and info.device == "cpu"
