"""Hostile input on the real chain (the shared in-process servers over the tiny model repository):
garbage bytes to every method of every stage, client input echoed without bound in error messages,
and finite but extreme features that overflow the models."""

from __future__ import annotations

import logging
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from recpipe.errors import clip
from recpipe.serving import codec
from recpipe.serving.malformed import Malformed
from recpipe.serving.outcomes import Outcome, OutcomeLog
from recpipe.v1 import (
    features_pb2,
    features_pb2_grpc,
    info_pb2,
    ranking_pb2,
    ranking_pb2_grpc,
    recommend_pb2,
    retrieval_pb2,
    retrieval_pb2_grpc,
)

STAGE_SERVICES = {
    "gateway": recommend_pb2.DESCRIPTOR.services_by_name["RecommendService"],
    "features": features_pb2.DESCRIPTOR.services_by_name["FeatureService"],
    "retrieval": retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"],
    "ranking": ranking_pb2.DESCRIPTOR.services_by_name["RankingService"],
}
#: Every server also hosts these.
COMMON_SERVICES = (
    info_pb2.DESCRIPTOR.services_by_name["InfoService"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
)
GARBAGE = {
    "truncated varint": b"\x08\xff",
    "bad wire type": b"\x0f\xff\xff\xff",
    "truncated length-delimited field": b"\x0a\x05ab",
    "random": np.random.default_rng(7).integers(0, 256, 64, dtype=np.uint8).tobytes(),
}


def _call(channel: grpc.Channel, method, payload: bytes) -> None:
    path = f"/{method.containing_service.full_name}/{method.name}"
    if method.client_streaming and method.server_streaming:
        list(channel.stream_stream(path)(iter([payload]), timeout=5))
    elif method.server_streaming:
        list(channel.unary_stream(path)(payload, timeout=5))
    elif method.client_streaming:
        channel.stream_unary(path)(iter([payload]), timeout=5)
    else:
        channel.unary_unary(path)(payload, timeout=5)


def _metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_garbage_bytes_to_every_method_of_every_stage_are_invalid_argument(serving_chain, caplog):
    for payload in GARBAGE.values():  # none of them parses as any of the request messages
        with pytest.raises(Exception):  # noqa: B017 - DecodeError; its import path differs by backend
            features_pb2.AugmentUserRequest.FromString(payload)
    caplog.set_level(logging.WARNING)
    calls = 0
    for stage, service in STAGE_SERVICES.items():
        server = getattr(serving_chain, stage)
        method_name = f"{service.name}/{service.methods[0].name}"
        label = f'recpipe_errors_total{{code="INVALID_ARGUMENT",method="{method_name}",stage="{stage}"}}'
        before = _metrics(server).get(label, 0.0)
        with grpc.insecure_channel(server.address) as channel:
            for svc in (service, *COMMON_SERVICES):
                for method in svc.methods:
                    for what, payload in GARBAGE.items():
                        with pytest.raises(grpc.RpcError) as info:
                            _call(channel, method, payload)
                        where = f"{stage} {method.full_name} {what}"
                        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, where
                        assert info.value.details() == "malformed request", where
                        calls += 1
        # counted in the metrics under their code, per method
        assert _metrics(server)[label] == before + len(GARBAGE), stage
    assert calls >= 4 * 6 * len(GARBAGE)
    # never a traceback per request; at most one summary line per server per interval, with a count
    assert not [r for r in caplog.records if r.exc_info or "Unexpected" in r.getMessage()]
    summaries = [r.getMessage() for r in caplog.records if "malformed request(s)" in r.getMessage()]
    assert len(summaries) <= len(STAGE_SERVICES), summaries


def test_chain_still_serves_after_garbage(serving_chain):
    from recpipe.client import RecommendClient

    with RecommendClient(serving_chain.gateway.address) as client:
        assert len(client.recommend(2, 50, 5).item_ids) == 5


def test_malformed_log_is_rate_limited_with_a_count(caplog):
    now = [100.0]
    log = OutcomeLog("features", every_s=10.0, clock=lambda: now[0])
    bad = Malformed(ValueError("Wire format was corrupt"), 2)
    with caplog.at_level(logging.WARNING, logger="recpipe.serving.outcomes"):
        for _ in range(50):
            log.record(Outcome.MALFORMED, "FeatureService/AugmentUser", bad.describe())
            now[0] += 0.1  # 50 requests over 5 s: one line
        now[0] += 6.0
        # 11 s after the first line: the next one, with the count
        log.record(Outcome.MALFORMED, "FeatureService/AugmentItems", bad.describe())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "features: 1 malformed request(s) answered INVALID_ARGUMENT" in lines[0]
    assert "features: 50 malformed request(s) in the last 11s" in lines[1]
    assert "AugmentItems" in lines[1] and "Wire format was corrupt" in lines[1]
    assert all(r.exc_info is None for r in caplog.records)


def test_clip():
    assert clip("abc") == "abc"
    assert clip("x" * 201) == "x" * 200 + "... (201 chars)"


def _long_dtype(t, n=200_000):
    return type(t)(dtype="x" * n, shape=list(t.shape), data=t.data)


def _long_shape(t, n=500_000):
    return type(t)(dtype=t.dtype, shape=[1] * n, data=t.data)


def _user(serving_chain):
    with grpc.insecure_channel(serving_chain.features.address) as channel:
        stub = features_pb2_grpc.FeatureServiceStub(channel)
        user = stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=2), timeout=10)
        items = stub.AugmentItems(
            features_pb2.AugmentItemsRequest(user_id=2, item_ids=codec.encode(np.arange(8, dtype=np.int64))), timeout=10
        )
    return user, items


@pytest.mark.parametrize("bad", [_long_dtype, _long_shape], ids=["200k-char dtype", "500k-dim shape"])
def test_echoed_client_input_is_bounded(serving_chain, bad):
    user, items = _user(serving_chain)
    ids = codec.encode(np.arange(8, dtype=np.int64))
    cases = [
        (serving_chain.features.address, lambda ch: features_pb2_grpc.FeatureServiceStub(ch).AugmentItems(
            features_pb2.AugmentItemsRequest(user_id=2, item_ids=bad(ids)), timeout=10)),
        (serving_chain.retrieval.address, lambda ch: retrieval_pb2_grpc.RetrievalServiceStub(ch).Retrieve(
            retrieval_pb2.RetrieveRequest(user_dense=bad(user.dense), user_sparse=user.sparse, k=10), timeout=10)),
        (serving_chain.ranking.address, lambda ch: ranking_pb2_grpc.RankingServiceStub(ch).Rank(
            ranking_pb2.RankRequest(user_dense=user.dense, user_sparse=user.sparse, item_dense=bad(items.dense),
                                    item_sparse=items.sparse), timeout=10)),
    ]
    for address, call in cases:
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel, \
                pytest.raises(grpc.RpcError) as info:
            call(channel)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (address, info.value.details()[:300])
        details = info.value.details()
        assert len(details) < 500, details[:600]
        assert "(200000 chars)" in details or "(500000 dims)" in details, details


def test_an_oversized_recommend_is_refused_resource_exhausted_by_the_gateway(serving_chain):
    """A RecommendRequest is 33 bytes at most: one carrying 1 MiB of unknown fields is refused before the
    gateway reads it whole (it took 64 MiB ones, eight at once growing it by a gigabyte, and answered OK),
    while the stages still take the chain's large batch messages."""
    from recpipe.gateway.servicer import MAX_REQUEST_BYTES

    valid = recommend_pb2.RecommendRequest(user_id=2, num_candidates=50, num_results=5).SerializeToString()
    padding = b"\0" * (1 << 20)
    unknown = b"\x9a\x06" + bytes([0x80, 0x80, 0x40])  # field 99, length-delimited, 1 MiB
    path = "/recpipe.v1.RecommendService/Recommend"
    with grpc.insecure_channel(serving_chain.gateway.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(path)(valid + unknown + padding, timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert len(info.value.details()) < 200
        # a request under the bound is read and answered, its unknown field ignored
        small = b"\x9a\x06" + bytes([0x80, 0x40]) + b"\0" * 8192  # 8 KiB
        assert len(valid + small) < MAX_REQUEST_BYTES
        reply = recommend_pb2.RecommendResponse.FromString(channel.unary_unary(path)(valid + small, timeout=10))
        assert len(reply.item_ids) == 5
    # a stage's own requests keep the chain's bound: 2 MiB of item ids in one call
    with grpc.insecure_channel(serving_chain.features.address) as channel:
        ids = codec.encode(np.arange(1 << 18, dtype=np.int64) % 8)
        with pytest.raises(grpc.RpcError) as info:  # over 10,000 ids: the contract's refusal, not the size's
            features_pb2_grpc.FeatureServiceStub(channel).AugmentItems(
                features_pb2.AugmentItemsRequest(user_id=2, item_ids=ids), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_extreme_item_features_are_out_of_range_not_nan(serving_chain):
    user, items = _user(serving_chain)
    dense = codec.decode(items.dense, "item_dense", "float32")
    extreme = codec.encode(np.full_like(dense, 3e38))
    with grpc.insecure_channel(serving_chain.ranking.address) as channel:
        stub = ranking_pb2_grpc.RankingServiceStub(channel)
        request = ranking_pb2.RankRequest(user_dense=user.dense, user_sparse=user.sparse, item_dense=extreme,
                                          item_sparse=items.sparse)
        with pytest.raises(grpc.RpcError) as info:
            reply = stub.Rank(request, timeout=10)
            pytest.fail(f"Rank answered OK with scores {codec.decode(reply.scores, 'scores', 'float32')}")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "out of the model's range" in info.value.details()
        ok = stub.Rank(ranking_pb2.RankRequest(user_dense=user.dense, user_sparse=user.sparse, item_dense=items.dense,
                                               item_sparse=items.sparse), timeout=10)
        assert np.isfinite(codec.decode(ok.scores, "scores", "float32")).all()


@pytest.mark.parametrize("value", [3e38, -3e38, 1e20])
def test_extreme_user_features_are_out_of_range_for_retrieval_and_ranking(serving_chain, value):
    user, items = _user(serving_chain)
    dense = codec.decode(user.dense, "user_dense", "float32")
    extreme = codec.encode(np.full_like(dense, value))
    with grpc.insecure_channel(serving_chain.retrieval.address) as channel, pytest.raises(grpc.RpcError) as info:
        reply = retrieval_pb2_grpc.RetrievalServiceStub(channel).Retrieve(
            retrieval_pb2.RetrieveRequest(user_dense=extreme, user_sparse=user.sparse, k=10), timeout=10)
        pytest.fail(f"Retrieve answered OK: {codec.decode(reply.item_ids, 'ids', 'int64')} "
                    f"{codec.decode(reply.scores, 'scores', 'float32')}")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "out of the model's range" in info.value.details()
    with grpc.insecure_channel(serving_chain.ranking.address) as channel:
        request = ranking_pb2.RankRequest(user_dense=extreme, user_sparse=user.sparse, item_dense=items.dense,
                                          item_sparse=items.sparse)
        try:
            reply = ranking_pb2_grpc.RankingServiceStub(channel).Rank(request, timeout=10)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "out of the model's range" in e.details()
        else:  # a saturated but finite answer is a legitimate one
            assert np.isfinite(codec.decode(reply.scores, "scores", "float32")).all()


def test_an_extreme_query_fails_alone_in_a_batch(small_models):
    """Batched core calls (the dynamic batcher): the out-of-range query's answer is non-finite and is
    refused per request; the others in the same batch keep their finite answers."""
    from recpipe.finite import check_finite
    from recpipe.ranking.contract import RankQuery
    from recpipe.ranking.core import RankingCore
    from recpipe.retrieval.contract import RetrieveQuery
    from recpipe.retrieval.core import RetrievalCore

    retrieval = RetrievalCore.load(small_models, device="cpu")
    ranking = RankingCore.load(small_models, device="cpu")
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(3, retrieval.user_dense_dim)).astype(np.float32)
    dense[1] = 3e38
    sparse = np.zeros((3, len(retrieval.user_table_sizes)), dtype=np.int64)
    found = retrieval.retrieve_batch([RetrieveQuery.checked(d, s, 10, retrieval.limits) for d, s in zip(dense, sparse, strict=True)])
    assert [bool(np.isfinite(c.scores).all()) for c in found] == [True, False, True]
    with pytest.raises(Exception, match="out of the model's range"):
        check_finite(found[1].scores, "retrieve")

    k = 6
    item_dense = rng.normal(size=(3, k, ranking.item_dense_dim)).astype(np.float32)
    item_dense[2] = 3e38
    item_sparse = np.zeros((k, len(ranking.item_table_sizes)), dtype=np.int64)
    user_dense = rng.normal(size=ranking.user_dense_dim).astype(np.float32)
    user_sparse = np.zeros(len(ranking.user_table_sizes), dtype=np.int64)
    scores = ranking.rank_batch([RankQuery.checked(user_dense, user_sparse, d, item_sparse, ranking.limits)
                                 for d in item_dense])
    assert [bool(np.isfinite(s).all()) for s in scores] == [True, True, False]
