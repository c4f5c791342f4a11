"""Liveness, readiness and connection age on real in-process servers over toy stage cores.

Kubernetes probes (deploy/k8s) ask the standard health service: readiness ``""`` (loaded; for the
gateway, the chain ready), liveness ``recpipe.Liveness`` (this process serves). On stop, both go
NOT_SERVING before the server stops taking RPCs. Every server closes client connections after its
``ConnectionAge`` so clients re-resolve (tests/integration/test_dns_reresolve.py shows the effect).
"""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from toy_stages import ToyFeatureCore, ToyWorld

from recpipe.features.servicer import FeatureStage
from recpipe.gateway.servicer import GatewayStage
from recpipe.serving.connection_age import ConnectionAge
from recpipe.serving.server import LIVENESS_SERVICE, StageServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def status(channel: grpc.Channel, service: str) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(reply.status)


def test_liveness_serves_while_loading_and_readiness_follows_load(servers):
    core = ToyFeatureCore(ToyWorld())
    server = servers.start(FeatureStage(lambda: core), load=False)
    with grpc.insecure_channel(server.address) as channel:
        assert (status(channel, LIVENESS_SERVICE), status(channel, "")) == (SERVING, NOT_SERVING)
        servers.run(server.load())
        assert (status(channel, LIVENESS_SERVICE), status(channel, "")) == (SERVING, SERVING)
    servers.stop(server)


def test_gateway_is_live_but_not_ready_while_its_stages_are_down(servers):
    # nothing listens on port 1: every stage is unreachable, so the chain is not ready
    gateway = servers.start(GatewayStage("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1"))
    with grpc.insecure_channel(gateway.address) as channel:
        assert status(channel, "") == NOT_SERVING
        assert status(channel, LIVENESS_SERVICE) == SERVING
    servers.stop(gateway)


def test_stop_reports_not_serving_before_the_server_stops(servers):
    core = ToyFeatureCore(ToyWorld())
    server = servers.start(FeatureStage(lambda: core))
    events: list[str] = []
    grpc_stop, shutdown = server.server.stop, server.health.enter_graceful_shutdown

    async def recording_shutdown():
        await shutdown()
        events.append("health NOT_SERVING")

    async def recording_stop(grace):
        events.append("server.stop")
        await grpc_stop(grace)

    server.health.enter_graceful_shutdown = recording_shutdown  # type: ignore[method-assign]
    server.server.stop = recording_stop  # type: ignore[method-assign]
    channel = grpc.insecure_channel(server.address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))
    seen: list[int] = []

    def read() -> None:
        try:
            for reply in watch:
                seen.append(int(reply.status))
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not seen:  # the stream's first answer: SERVING
        reader.join(0.02)
    servers.stop(server, 2.0)
    reader.join(10)
    channel.close()
    assert events == ["health NOT_SERVING", "server.stop"]
    assert seen == [SERVING, NOT_SERVING]  # a watching client was told before its stream ended


def test_server_closes_connections_older_than_the_max_age(servers):
    core = ToyFeatureCore(ToyWorld())

    async def start() -> StageServer:
        server = await StageServer.start(FeatureStage(lambda: core), connection_age=ConnectionAge(0.3, 1.0))
        await server.load()
        return server

    server = servers.run(start())
    went_idle = threading.Event()
    states: list[grpc.ChannelConnectivity] = []

    def watch(state: grpc.ChannelConnectivity) -> None:
        states.append(state)
        if state == grpc.ChannelConnectivity.IDLE and grpc.ChannelConnectivity.READY in states:
            went_idle.set()

    with grpc.insecure_channel(server.address) as channel:
        assert status(channel, "") == SERVING
        channel.subscribe(watch)
        # GOAWAY after ~0.3 s: the channel leaves READY for IDLE (and would re-resolve on the next call)
        assert went_idle.wait(30), states
        assert status(channel, "") == SERVING  # and the next call reconnects
        channel.unsubscribe(watch)
    servers.stop(server)
