"""recpipe.serving.healthcheck, the command the compose healthchecks run, against a real gRPC health service."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from recpipe.serving.healthcheck import main


@pytest.fixture()
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(None)


def test_serving_is_healthy(health_server, capsys) -> None:
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main([f"127.0.0.1:{port}"]) == 0
    assert "SERVING" in capsys.readouterr().out


def test_not_serving_is_unhealthy(health_server, capsys) -> None:
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main([f"127.0.0.1:{port}"]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err


def test_unknown_service_is_unhealthy(health_server, capsys) -> None:
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main([f"127.0.0.1:{port}", "--service", "recpipe.v1.NoSuchService"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_target_from_environment(health_server, monkeypatch) -> None:
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    monkeypatch.setenv("RECPIPE_HEALTH_TARGET", f"127.0.0.1:{port}")
    assert main([]) == 0


def test_nothing_listening_is_unhealthy(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main([f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys) -> None:
    assert main(["127.0.0.1:1", "--timeout", "0"]) == 2
    assert main(["--no-such-flag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("recpipe.serving.healthcheck: error:") for line in err)
