"""The gateway spreads a stage's calls over every address its DNS name resolves to.

This is what `docker compose up --scale ranking=3` relies on: Docker's DNS answers `ranking` with one
A record per replica, and the gateway's `dns:///ranking:50054` channel (round_robin) must use them all.
Here two real ranking servers (RankingCore over the test model repository) listen on the same port of
two loopback addresses, 127.0.0.1 and 127.0.0.2, and a small DNS server answers one name with both
addresses. The gateway gets `dns://127.0.0.1:DNSPORT/ranking.recpipe.test:PORT`: gRPC's own DNS
resolver (c-ares) asking that server instead of the system's, the same code path `dns:///` takes in a
container. Both replicas count their Rank calls (their Prometheus request counters).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from recpipe.client import RecommendClient

NAME = "ranking.recpipe.test"
REPLICA_HOSTS = ("127.0.0.1", "127.0.0.2")
RANK_METHOD = "RankingService/Rank"
_A, _IN = 1, 1


class TinyDNS:
    """Answers A queries for known names over UDP (what a resolver needs, nothing more): every other
    question gets an empty NOERROR answer for a known name, NXDOMAIN for an unknown one."""

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = {k.lower(): v for k, v in records.items()}
        self.queries: list[tuple[str, int]] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self.sock.recvfrom(512)
            except OSError:
                return
            try:
                self.sock.sendto(self._answer(query), peer)
            except (OSError, IndexError, struct.error, UnicodeDecodeError):
                continue  # a malformed query gets no answer, as from a real server under load

    def _answer(self, query: bytes) -> bytes:
        (txid,) = struct.unpack(">H", query[:2])
        pos, labels = 12, []
        while query[pos]:
            n = query[pos]
            labels.append(query[pos + 1 : pos + 1 + n].decode("ascii"))
            pos += n + 1
        qtype, qclass = struct.unpack(">HH", query[pos + 1 : pos + 5])
        question = query[12 : pos + 5]
        name = ".".join(labels).lower()
        self.queries.append((name, qtype))
        ips = self.records.get(name, []) if (qtype, qclass) == (_A, _IN) else []
        rcode = 0 if name in self.records else 3
        # header: id, flags (response, recursion desired+available, rcode), 1 question, len(ips) answers
        out = struct.pack(">HHHHHH", txid, 0x8180 | rcode, 1, len(ips), 0, 0) + question
        for ip in ips:  # name as a pointer to the question, type A, class IN, TTL 1 s, 4 bytes
            out += b"\xc0\x0c" + struct.pack(">HHIH", _A, _IN, 1, 4) + socket.inet_aton(ip)
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def tiny_dns() -> Iterator[TinyDNS]:
    dns = TinyDNS({NAME: list(REPLICA_HOSTS)})
    yield dns
    dns.close()


def rank_calls(server) -> float:
    value = server.metrics.registry.get_sample_value(
        "recpipe_requests_total", {"stage": "ranking", "method": RANK_METHOD}
    )
    return value or 0.0


def test_gateway_round_robins_over_every_address_of_a_dns_name(
    serving_threads, serving_chain, small_models: Path, dataset_info: dict[str, int], tiny_dns: TinyDNS
) -> None:
    from recpipe.gateway.servicer import GatewayStage
    from recpipe.stages import REGISTRY

    def ranking_stage(models: Path, device: str):
        return REGISTRY.build(REGISTRY.config("ranking", models_dir=models, device=device))

    first = serving_threads.start(ranking_stage(small_models, device="cpu"), host=REPLICA_HOSTS[0], port=0)
    started = [first]
    gateway = None
    try:
        try:
            second = serving_threads.start(
                ranking_stage(small_models, device="cpu"), host=REPLICA_HOSTS[1], port=first.port
            )
        except Exception as e:  # a sandbox without 127.0.0.2 cannot host this test
            pytest.skip(f"cannot listen on {REPLICA_HOSTS[1]}:{first.port}: {e}")
        started.append(second)
        target = f"dns://127.0.0.1:{tiny_dns.port}/{NAME}:{first.port}"
        gateway = serving_threads.start(
            GatewayStage(serving_chain.features.address, serving_chain.retrieval.address, target)
        )
        requests = 20
        with RecommendClient(gateway.address, timeout=30) as client:
            for i in range(requests):
                rec = client.recommend(user_id=i % dataset_info["num_users"], num_candidates=50, num_results=5)
                assert len(rec.item_ids) == 5
        counts = [rank_calls(first), rank_calls(second)]
    finally:
        if gateway is not None:
            serving_threads.stop(gateway)
        for server in started:
            serving_threads.stop(server)
    assert (NAME, _A) in tiny_dns.queries, "the gateway did not resolve the name through DNS"
    assert sum(counts) == requests, counts  # one Rank per Recommend, all answered by the two replicas
    # round_robin alternates once both connections are up: each replica takes a fair share
    assert min(counts) >= requests // 4, counts


def test_a_channel_round_robins_over_an_address_list(serving_threads) -> None:
    """``recpipe serve --replicas STAGE=N`` names every replica in one target, ``ipv4:HOST:P1,HOST:P2``:
    the channel helper takes it as it is (``normalize_target``) and its round_robin policy spreads the
    calls over both servers, one by one, on one channel."""
    from toy_stages import ToyFeatureCore, ToyWorld

    from recpipe.config import normalize_target
    from recpipe.features.servicer import FeatureStage
    from recpipe.serving.channels import make_blocking_channel
    from recpipe.v1 import features_pb2, features_pb2_grpc

    servers = [serving_threads.start(FeatureStage(lambda: ToyFeatureCore(ToyWorld()))) for _ in range(2)]
    try:
        target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
        assert normalize_target(target) == target
        calls = 20
        with make_blocking_channel(target) as channel:
            stub = features_pb2_grpc.FeatureServiceStub(channel)
            for i in range(calls):
                assert stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=i % 10), timeout=10).user_id == i % 10
        counts = [s.metrics.registry.get_sample_value(
            "recpipe_requests_total", {"stage": "features", "method": "FeatureService/AugmentUser"}) or 0.0
            for s in servers]
    finally:
        for s in servers:
            serving_threads.stop(s)
    assert sum(counts) == calls and min(counts) >= calls // 4, counts
