"""The serving infrastructure on real in-process gRPC servers over toy numpy stage cores: the error
interceptor, health, reflection, InfoService, metrics, draining on stop, port handling, round-robin."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from toy_stages import ToyFeatureCore

from recpipe.errors import (
    ArtifactMismatch,
    BadRequest,
    DeadlineExceeded,
    Overloaded,
    StageUnavailable,
    UnknownUser,
    UsageError,
)
from recpipe.features.servicer import FeatureStage
from recpipe.serving import codec
from recpipe.serving.channels import make_blocking_channel
from recpipe.serving.server import ServerThread
from recpipe.v1 import features_pb2, features_pb2_grpc, info_pb2, info_pb2_grpc


def feature_server(servers, world, *, load=True, workers=0, metrics_port=None):
    core = ToyFeatureCore(world)
    server = servers.start(FeatureStage(lambda: core, workers=workers), load=load, metrics_port=metrics_port)
    return server, core


@pytest.fixture(scope="module")
def features(servers, world):
    server, core = feature_server(servers, world, metrics_port=0)
    channel = grpc.insecure_channel(server.address)
    yield server, core, features_pb2_grpc.FeatureServiceStub(channel)
    channel.close()


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (BadRequest("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (UnknownUser("who"), grpc.StatusCode.NOT_FOUND),
        (ArtifactMismatch("models/x: corrupt"), grpc.StatusCode.FAILED_PRECONDITION),
        (Overloaded("busy"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (StageUnavailable("retrieval down"), grpc.StatusCode.UNAVAILABLE),
        (DeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (UsageError("flag"), grpc.StatusCode.INVALID_ARGUMENT),
        (ZeroDivisionError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_interceptor_maps_errors_and_keeps_serving(features, error, code, caplog):
    _, core, stub = features
    core.fail_with = error
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=1), timeout=5)
    finally:
        core.fail_with = None
    assert info.value.code() == code
    assert str(error) in info.value.details()
    if code == grpc.StatusCode.INTERNAL:
        assert any("FeatureService/AugmentUser failed" in r.getMessage() for r in caplog.records)
    reply = stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=1), timeout=5)
    assert reply.user_id == 1


def test_malformed_tensor_is_invalid_argument(features):
    _, _, stub = features
    good = codec.encode(np.arange(5, dtype=np.int64))
    bad = [
        codec.encode(np.arange(5, dtype=np.int32)),  # dtype
        type(good)(dtype="int64", shape=[5], data=good.data[:-3]),  # byte length
        codec.encode(np.arange(6, dtype=np.int64).reshape(2, 3)),  # shape
        codec.encode(np.array([1, 10**9], dtype=np.int64)),  # ids out of range (the core's check)
        codec.encode(np.empty(0, dtype=np.int64)),  # no ids
    ]
    for tensor in bad:
        with pytest.raises(grpc.RpcError) as info:
            stub.AugmentItems(features_pb2.AugmentItemsRequest(user_id=1, item_ids=tensor), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "item_ids" in info.value.details()
    reply = stub.AugmentItems(features_pb2.AugmentItemsRequest(user_id=1, item_ids=good), timeout=5)
    assert codec.decode(reply.dense, "dense", "float32").shape[0] == 5


def test_health_is_serving_only_after_load(servers, world):
    server, _ = feature_server(servers, world, load=False)
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = features_pb2_grpc.FeatureServiceStub(channel)
        for service in ("", "recpipe.v1.FeatureService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=1), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        servers.run(server.load())
        reply = health.Check(health_pb2.HealthCheckRequest(service="recpipe.v1.FeatureService"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    servers.stop(server)


def test_reflection_lists_services(features):
    server, _, _ = features
    with grpc.insecure_channel(server.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {
            "recpipe.v1.FeatureService",
            "recpipe.v1.InfoService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= services
        method = db.FindFileContainingSymbol("recpipe.v1.FeatureService")
        assert method.name == "recpipe/v1/features.proto"


def test_info_service(features):
    server, _, _ = features
    with grpc.insecure_channel(server.address) as channel:
        info = info_pb2_grpc.InfoServiceStub(channel).GetInfo(info_pb2.GetInfoRequest(), timeout=5)
    assert info.stage == "features"
    assert info.model_version == "toy-1"
    assert info.details["num_items"] == "400"
    assert info.recpipe_version


def test_metrics_endpoint_counts_requests_errors_latency(features):
    server, _, stub = features
    stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=2), timeout=5)
    with pytest.raises(grpc.RpcError):
        stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=-5), timeout=5)
    labels = 'method="FeatureService/AugmentUser",stage="features"'

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    # the client has its status as soon as it is sent; the server's bookkeeping of that call (the
    # in-flight gauge) finishes just after, so a scrape right away may still count it (seen in CI)
    deadline = time.monotonic() + 5
    lines = scrape()
    while lines[f"recpipe_in_flight_requests{{{labels}}}"] != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
        lines = scrape()
    assert lines[f"recpipe_requests_total{{{labels}}}"] >= 2
    assert lines[f'recpipe_errors_total{{code="NOT_FOUND",{labels}}}'] >= 1
    assert lines[f"recpipe_request_latency_seconds_count{{{labels}}}"] >= 2
    assert lines[f"recpipe_in_flight_requests{{{labels}}}"] == 0


def test_stop_drains_in_flight_request_and_refuses_new_ones(servers, world):
    server, core = feature_server(servers, world, workers=1)
    core.delay_s = 0.8
    started = threading.Event()
    user_features = core.user_features

    def signalling(query: object) -> object:
        started.set()
        return user_features(query)

    core.user_features = signalling  # type: ignore[assignment,method-assign]
    channel = grpc.insecure_channel(server.address)
    stub = features_pb2_grpc.FeatureServiceStub(channel)
    stub.AugmentItems(
        features_pb2.AugmentItemsRequest(user_id=1, item_ids=codec.encode(np.arange(3, dtype=np.int64))), timeout=5
    )  # connect first, so the slow call below is in flight when stop begins
    result: dict[str, object] = {}

    def call() -> None:
        try:
            result["reply"] = stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=4), timeout=10)
        except grpc.RpcError as e:
            result["error"] = e

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert started.wait(10), "the slow call never reached the core"
    stopping = threading.Thread(target=servers.stop, args=(server, 5.0), daemon=True)
    stopping.start()
    # stop has begun once the server refuses a new RPC (its health check is one)
    health = health_pb2_grpc.HealthStub(channel)
    for _ in range(500):
        try:
            health.Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError as e:
            # One sent after shutdown began is refused as UNAVAILABLE. One that reached the transport just
            # as shutdown began is either cancelled or, never dispatched, left to its deadline (both seen in
            # CI on a loaded box; grpc/grpc#10418). The refusal itself is asserted on the call below.
            assert e.code() in (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED
            ), e
            break
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as info:
        stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=4), timeout=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    caller.join(10)
    stopping.join(10)
    assert "error" not in result, result
    assert result["reply"].user_id == 4  # type: ignore[attr-defined]
    channel.close()


def test_busy_port_is_a_usage_error(features, servers, world):
    server, _, _ = features
    with pytest.raises(UsageError, match="cannot listen"):
        servers.start(FeatureStage(lambda: ToyFeatureCore(world)), port=server.port)


def test_round_robin_channel_spreads_calls(servers, world):
    a, core_a = feature_server(servers, world)
    b, core_b = feature_server(servers, world)
    seen = {"a": 0, "b": 0}
    core_a.user_features = _counting(core_a.user_features, seen, "a")  # type: ignore[method-assign]
    core_b.user_features = _counting(core_b.user_features, seen, "b")  # type: ignore[method-assign]
    # One name, several addresses: what a dns:/// name with several A records resolves to.
    with make_blocking_channel(f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}") as channel:
        stub = features_pb2_grpc.FeatureServiceStub(channel)
        for _ in range(20):
            stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=3), timeout=5, wait_for_ready=True)
    assert seen["a"] >= 5 and seen["b"] >= 5, seen
    servers.stop(a)
    servers.stop(b)


def _counting(fn, seen, key):
    def wrapped(*args):
        seen[key] += 1
        return fn(*args)

    return wrapped


def test_a_stopped_server_thread_refuses_work_instead_of_waiting_forever():
    servers = ServerThread()
    servers.close()
    with pytest.raises(RuntimeError, match="loop has stopped"):
        servers.run(asyncio.sleep(0))


def test_an_answer_grpc_could_not_send_is_counted_not_logged_with_a_traceback(caplog) -> None:
    """gRPC's core logs an answer whose call had ended as an ERROR with a traceback (ExecuteBatchError):
    a client that disconnects with calls in flight wrote one per call. A method this process serves is
    counted as cancelled instead; any other record passes."""
    import logging

    from grpc._cython.cygrpc import ExecuteBatchError

    from recpipe.serving.interceptor import ServingInterceptor
    from recpipe.serving.metrics import ServerMetrics

    metrics = ServerMetrics("features")
    interceptor = ServingInterceptor(metrics)
    # a method no other server of this test process serves (the first server serving it counts it)
    interceptor._wrapped["/recpipe.v1.FeatureService/Unsent"] = None  # type: ignore[assignment]
    core = logging.getLogger("grpc._cython.cygrpc")
    error = ExecuteBatchError("Failed execute_batch")
    with caplog.at_level(logging.WARNING):
        for method in ("/recpipe.v1.FeatureService/Unsent", "/other.Service/Method"):
            core.error("ExecuteBatchError raised in core by servicer method [%s]", method,
                       exc_info=(ExecuteBatchError, error, None))
    logged = [r for r in caplog.records if r.name == "grpc._cython.cygrpc"]
    assert [r.getMessage() for r in logged] == ["ExecuteBatchError raised in core by servicer method "
                                                "[/other.Service/Method]"]
    assert metrics.registry.get_sample_value("recpipe_errors_total", {
        "stage": "features", "method": "FeatureService/Unsent", "code": "CANCELLED"}) == 1
    assert any("its answer could not be sent" in r.getMessage() for r in caplog.records)
