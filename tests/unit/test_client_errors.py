"""RecommendClient's UNAVAILABLE: gRPC's "nothing answered there" becomes "cannot reach the gateway";
an UNAVAILABLE a server sent keeps its own words (a real grpc server on a loopback port)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from recpipe.client import RecommendClient
from recpipe.errors import StageUnavailable


@pytest.fixture
def refusing_gateway() -> Iterator[str]:
    """A server whose Recommend answers UNAVAILABLE "gateway: still starting", as a gateway does before
    its chain is built."""
    def recommend(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAVAILABLE, "gateway: still starting")

    handler = grpc.method_handlers_generic_handler(
        "recpipe.v1.RecommendService", {"Recommend": grpc.unary_unary_rpc_method_handler(recommend)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_an_unavailable_the_server_sent_keeps_its_words(refusing_gateway: str) -> None:
    with RecommendClient(refusing_gateway, timeout=5) as client, pytest.raises(StageUnavailable) as e:
        client.recommend(1, 10, 5)
    assert str(e.value) == "gateway: still starting"


def test_nothing_listening_is_cannot_reach() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with RecommendClient(f"127.0.0.1:{port}", timeout=5) as client, pytest.raises(StageUnavailable) as e:
        client.recommend(1, 10, 5)
    assert str(e.value).startswith(f"cannot reach the gateway at 127.0.0.1:{port} (gave up after ")
    assert str(e.value).endswith("; is `recpipe serve` running there?")
