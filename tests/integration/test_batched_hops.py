"""Batched hops over real gRPC: the stages' batch RPCs (each entry its own answer or error, its own
deadline), and a gateway sending the queries in flight as one batch call per stage method, whose
answers equal an unbatched gateway's over the same stages."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from recpipe.client import RecommendClient
from recpipe.errors import UnknownUser
from recpipe.gateway.options import DEFAULT_HOP_UPSTREAM_WAIT_US, GatewayOptions
from recpipe.gateway.servicer import GatewayStage
from recpipe.serving import codec
from recpipe.serving.threads import usable_cores
from recpipe.v1 import (
    features_pb2,
    features_pb2_grpc,
    ranking_pb2,
    ranking_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)

USERS = list(range(12))


def wait_serving(address: str, timeout: float = 30.0) -> None:
    import time

    from recpipe.serving.supervisor import health_status

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        while health_status(channel) != "SERVING":
            assert time.monotonic() < deadline, f"{address} not SERVING after {timeout} s"
            time.sleep(0.05)


def _rank_requests(address: str, users: list[int], k: int = 30) -> list[ranking_pb2.RankRequest]:
    """Real Rank requests: each user's features and the features of its first k items."""
    with grpc.insecure_channel(address) as channel:
        features = features_pb2_grpc.FeatureServiceStub(channel)
        out = []
        for u in users:
            user = features.AugmentUser(features_pb2.AugmentUserRequest(user_id=u))
            items = features.AugmentItems(features_pb2.AugmentItemsRequest(
                user_id=u, item_ids=codec.encode(np.arange(u, u + k, dtype=np.int64))))
            out.append(ranking_pb2.RankRequest(user_dense=user.dense, user_sparse=user.sparse,
                                               item_dense=items.dense, item_sparse=items.sparse))
    return out


def test_a_batch_call_answers_each_entry_alone_and_a_bad_entry_fails_only_itself(serving_chain) -> None:
    requests = _rank_requests(serving_chain.features.address, [1, 2, 3])
    bad = ranking_pb2.RankRequest()
    bad.CopyFrom(requests[1])
    bad.item_sparse.dtype = "float32"  # a malformed tensor: INVALID_ARGUMENT for this entry only
    entries = [requests[0], bad, requests[1], requests[2], requests[2]]
    timeouts = [0, 0, 5_000_000, 1, 0]  # entry 3 has 1 µs left: DEADLINE_EXCEEDED alone
    with grpc.insecure_channel(serving_chain.ranking.address) as channel:
        stub = ranking_pb2_grpc.RankingServiceStub(channel)
        reply = stub.RankBatch(ranking_pb2.RankBatchRequest(entries=entries, timeout_us=timeouts), timeout=10)
        alone = [stub.Rank(r, timeout=10) for r in requests]
    assert [e.WhichOneof("result") for e in reply.entries] == ["ok", "error", "ok", "error", "ok"]
    assert reply.entries[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "item_sparse" in reply.entries[1].error.message
    assert reply.entries[3].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    for got, want in ((reply.entries[0].ok, alone[0]), (reply.entries[2].ok, alone[1]), (reply.entries[4].ok, alone[2])):
        np.testing.assert_allclose(codec.decode(got.scores, "scores", "float32"),
                                   codec.decode(want.scores, "scores", "float32"), rtol=1e-5, atol=1e-6)
    # the live entries' core work ran as one call, each entry with its own timing
    oks = [reply.entries[i].ok for i in (0, 2, 4)]
    assert {r.batch_size for r in oks} == {3} and all(r.server_us > 0 and r.compute_us > 0 for r in oks)


def test_every_stage_method_has_a_batch_call(serving_chain) -> None:
    with grpc.insecure_channel(serving_chain.features.address) as channel:
        stub = features_pb2_grpc.FeatureServiceStub(channel)
        users = stub.AugmentUserBatch(features_pb2.AugmentUserBatchRequest(
            entries=[features_pb2.AugmentUserRequest(user_id=u) for u in (4, 10**9, 5)]), timeout=10)
        assert [e.WhichOneof("result") for e in users.entries] == ["ok", "error", "ok"]
        assert users.entries[1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert users.entries[2].ok.user_id == 5
        items = stub.AugmentItemsBatch(features_pb2.AugmentItemsBatchRequest(entries=[
            features_pb2.AugmentItemsRequest(user_id=4, item_ids=codec.encode(np.arange(7, dtype=np.int64))),
            features_pb2.AugmentItemsRequest(user_id=4, item_ids=codec.encode(np.array([-1], dtype=np.int64)))]),
            timeout=10)
        assert [e.WhichOneof("result") for e in items.entries] == ["ok", "error"]
        assert items.entries[0].ok.dense.shape[0] == 7
    user = users.entries[0].ok
    with grpc.insecure_channel(serving_chain.retrieval.address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        found = stub.RetrieveBatch(retrieval_pb2.RetrieveBatchRequest(entries=[
            retrieval_pb2.RetrieveRequest(user_dense=user.dense, user_sparse=user.sparse, k=k) for k in (5, 9)]),
            timeout=10)
        alone = stub.Retrieve(retrieval_pb2.RetrieveRequest(user_dense=user.dense, user_sparse=user.sparse, k=9))
    assert [tuple(e.ok.item_ids.shape) for e in found.entries] == [(5,), (9,)]
    np.testing.assert_array_equal(codec.decode(found.entries[1].ok.item_ids, "ids", "int64"),
                                  codec.decode(alone.item_ids, "ids", "int64"))


@pytest.fixture(scope="module")
def gateways(serving_chain, serving_threads):
    """Three gateways over the session's stages: batched hops (the default), unbatched, and batched
    hops that wait for the queries upstream of them (``--hop-upstream-wait-us``)."""
    targets = [serving_chain[name].address for name in ("features", "retrieval", "ranking")]
    batched = serving_threads.start(GatewayStage(*targets, GatewayOptions()))
    unbatched = serving_threads.start(GatewayStage(*targets, GatewayOptions(hop_max_batch=1)))
    waiting = serving_threads.start(GatewayStage(*targets, GatewayOptions(hop_upstream_wait_us=200_000)))
    yield batched, unbatched, waiting
    for g in (batched, unbatched, waiting):
        serving_threads.stop(g)


def _recommend_all(address: str, users: list[int], concurrency: int) -> list[object]:
    """Each user's Recommend on its own client, ``concurrency`` at once. With one thread per user, every
    client connects (a GetInfo call) before any sends: then the queries are in flight together, not
    spread over the clients' connection set-ups (a loaded machine took longer than a hop's wait)."""
    together = threading.Barrier(len(users)) if concurrency == len(users) else None

    def one(u: int) -> object:
        with RecommendClient(address) as client:
            if together is not None:
                client.info(timeout=10)
                together.wait(timeout=30)
            try:
                return client.recommend(u, num_candidates=60, num_results=8)
            except UnknownUser as e:
                return e

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, users))


def assert_same_answers(got: list[object], want: list[object]) -> None:
    """Each Recommend answer (or unknown user) of ``got`` equals ``want``'s."""
    for g, w in zip(got, want, strict=True):
        if isinstance(w, UnknownUser):
            assert isinstance(g, UnknownUser)  # it failed alone: its batch-mates were answered
            continue
        assert not isinstance(g, Exception)
        np.testing.assert_array_equal(g.item_ids, w.item_ids)  # type: ignore[attr-defined]
        np.testing.assert_allclose(g.scores, w.scores, rtol=1e-5, atol=1e-6)  # type: ignore[attr-defined]
        assert [t.stage for t in g.timings] == [t.stage for t in w.timings]  # type: ignore[attr-defined]


def test_a_batched_gateway_answers_as_an_unbatched_one_and_batches_the_queries_in_flight(gateways,
                                                                                          dataset_info) -> None:
    batched, unbatched, _ = gateways
    users = [*USERS, dataset_info["num_users"] + 5, *USERS]  # one unknown user among them
    for g in (batched, unbatched):  # its readiness has seen every stage SERVING
        wait_serving(g.address)
    got = _recommend_all(batched.address, users, concurrency=len(users))
    want = _recommend_all(unbatched.address, users, concurrency=4)
    assert_same_answers(got, want)
    hops = batched.stage.info().details
    calls = {k: v for k, v in hops.items() if k.startswith("hop_")}
    assert set(calls) == {"hop_AugmentUser", "hop_AugmentItems", "hop_Retrieve", "hop_Rank"}
    # the stages got fewer calls than the gateway's queries: some went together
    sent = [int(v.split(" calls in ")[0]) for v in calls.values()]
    batches = [int(v.split(" calls in ")[1].split(" ")[0]) for v in calls.values()]
    assert sum(batches) < sum(sent), calls
    # the default upstream wait, resolved against this machine: on only where the chain's processes
    # (the gateway and the three stages here) outnumber the cores
    cores = usable_cores()
    assert hops["upstream_wait_us"] == f"{DEFAULT_HOP_UPSTREAM_WAIT_US if cores < 4 else 0} (auto: 4 processes, {cores} cores)"


def _hop_counts(gateway) -> dict[str, tuple[int, int]]:  # type: ignore[no-untyped-def]
    """hop -> (calls, batch calls), from the gateway's GetInfo."""
    details = gateway.stage.info().details
    return {k: (int(v.split(" calls in ")[0]), int(v.split(" calls in ")[1].split(" ")[0]))
            for k, v in details.items() if k.startswith("hop_")}


def _lone_counts(gateway) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """hop -> the calls it sent for a query alone in the gateway (``Hop.alone``), from GetInfo."""
    details = gateway.stage.info().details
    return {k: int(v.split("(")[1].split(" of a lone query")[0]) for k, v in details.items() if k.startswith("hop_")}


def test_hops_that_wait_for_the_queries_upstream_send_them_together_with_the_same_answers(gateways,
                                                                                         dataset_info) -> None:
    _, unbatched, waiting = gateways
    users = [*USERS, dataset_info["num_users"] + 5, *USERS]
    for g in (unbatched, waiting):
        wait_serving(g.address)
    before = _hop_counts(waiting)
    lone_before = _lone_counts(waiting)
    lone = _recommend_all(waiting.address, USERS[:1], concurrency=1)[0]  # nothing ahead of it: no wait
    # alone in the gateway, it sent each of its four calls from its own task, past the hops' queues
    assert {hop: n - lone_before[hop] for hop, n in _lone_counts(waiting).items()} == dict.fromkeys(before, 1)
    got = _recommend_all(waiting.address, users, concurrency=len(users))
    want = _recommend_all(unbatched.address, users, concurrency=4)
    assert not isinstance(lone, Exception) and lone.timings[-1].observed_us < 150_000  # type: ignore[attr-defined]
    for g, w in zip(got, want, strict=True):
        if isinstance(w, UnknownUser):
            assert isinstance(g, UnknownUser)  # it left the chain at its first hop; the others did not wait for it
            continue
        assert not isinstance(g, Exception)
        np.testing.assert_array_equal(g.item_ids, w.item_ids)  # type: ignore[attr-defined]
        np.testing.assert_allclose(g.scores, w.scores, rtol=1e-5, atol=1e-6)  # type: ignore[attr-defined]
    after = _hop_counts(waiting)
    assert waiting.stage.info().details["upstream_wait_us"].startswith("200000 (200000: 4 processes")
    for hop in ("hop_Retrieve", "hop_AugmentItems", "hop_Rank"):
        calls, batches = (after[hop][i] - before[hop][i] for i in (0, 1))
        # less the unknown user, plus the lone query; the rest met at each later hop: the lone query's
        # call and one or two batch calls (without the wait, 5-6 here)
        assert calls == len(users) and batches <= 3, after
