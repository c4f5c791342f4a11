"""A gateway finds a ranking replica added after it started, without a restart (max connection age).

gRPC resolves a ``dns:///`` name when a channel connects and again only when a connection drops, so a
long-lived gateway channel would never see a replica scaled up later. Every recpipe server closes a
client connection after ``--max-connection-age`` (default 30 s; gRPC sends GOAWAY and lets RPCs in
flight finish), the client reconnects, re-resolves and round_robin adds the new address. The pair under
test runs a 3 s age: recpipe's channels re-resolve at most once a second (gRPC's own minimum is 30 s),
so the replica must be found within about 3 s, far below what gRPC's minimum alone would allow.

Here on loopback: a real DNS server (dnslib) answers ``ranking.recpipe.test`` with 127.0.0.1, and
after the gateway has been serving for a moment with 127.0.0.1 and 127.0.0.2; the gateway's target is
``dns://127.0.0.1:DNSPORT/ranking.recpipe.test:PORT`` (gRPC's c-ares resolver asking that server, the
code path ``dns:///`` takes in a cluster). Recommend calls run throughout; the test measures how long
replica 2 takes to get its first Rank call, and checks that no call failed across the reconnects. A
control pair with the connection age off (``0``), under the same load for as long, never reaches its
second replica. Prints the timing (``pytest -s``); BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import DNSLogger, DNSServer

from recpipe.client import RecommendClient
from recpipe.errors import RecpipeError
from recpipe.serving.connection_age import ConnectionAge
from recpipe.serving.server import StageServer

pytestmark = pytest.mark.slow

RANK_METHOD = "RankingService/Rank"
#: The connection age of the pair under test (the default, 30 s, works the same way, ten times slower).
AGE_S = 3.0
#: Longest wait for the new replica: the age plus gRPC's +-10 % jitter, recpipe's 1 s minimum between
#: resolutions (``channels.DNS_MIN_RESOLUTION_INTERVAL_MS``) and a loaded 2-core machine's slack; under
#: gRPC's own 30 s minimum, which the first resolution at the gateway's start would still hold, it fails.
DISCOVERY_TIMEOUT_S = AGE_S * 1.1 + 10.0


class Zone:
    """A dnslib resolver over a mutable name -> addresses map (A records, TTL 1 s)."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.queries: list[tuple[str, float]] = []
        self._lock = threading.Lock()

    def set(self, name: str, addresses: list[str]) -> None:
        with self._lock:
            self.records[name.lower()] = list(addresses)

    def resolve(self, request, handler):  # dnslib's BaseResolver interface
        reply = request.reply()
        name = str(request.q.qname).rstrip(".").lower()
        with self._lock:
            addresses = self.records.get(name)
            self.queries.append((name, time.monotonic()))
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for ip in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=1))
        return reply


@pytest.fixture()
def dns() -> Iterator[tuple[Zone, int]]:
    zone = Zone()
    server = DNSServer(zone, address="127.0.0.1", port=0, logger=DNSLogger(logf=lambda _: None))
    server.start_thread()
    try:
        yield zone, server.server.server_address[1]
    finally:
        server.stop()
        server.server.server_close()


@dataclass
class Load:
    """Recommend calls, one after another, on a thread, counting answers and failures."""

    address: str
    num_users: int
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with RecommendClient(self.address, timeout=10) as client:
            i = 0
            while not self.stop.is_set():
                try:
                    client.recommend(user_id=i % self.num_users, num_candidates=50, num_results=5)
                    self.ok += 1
                except RecpipeError as e:
                    self.errors.append(str(e))
                i += 1
                time.sleep(0.02)


def rank_calls(server: StageServer) -> float:
    value = server.metrics.registry.get_sample_value(
        "recpipe_requests_total", {"stage": "ranking", "method": RANK_METHOD})
    return value or 0.0


def test_gateway_finds_a_replica_added_after_it_started(
    serving_threads, serving_chain, small_models: Path, dataset_info: dict[str, int], dns: tuple[Zone, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from recpipe.gateway.servicer import GatewayStage
    from recpipe.stages import REGISTRY

    def ranking_stage(models: Path, device: str):
        return REGISTRY.build(REGISTRY.config("ranking", models_dir=models, device=device))

    monkeypatch.delenv("RECPIPE_MAX_CONNECTION_AGE", raising=False)
    monkeypatch.delenv("RECPIPE_MAX_CONNECTION_AGE_GRACE", raising=False)
    zone, dns_port = dns
    started: list[StageServer] = []

    def start(stage, host: str, port: int, age: ConnectionAge) -> StageServer:
        async def go() -> StageServer:
            server = await StageServer.start(stage, host=host, port=port, connection_age=age)
            started.append(server)
            await server.load()
            return server
        return serving_threads.run(go())

    def ranking(host: str, port: int, age: ConnectionAge) -> StageServer:
        try:
            return start(ranking_stage(small_models, device="cpu"), host, port, age)
        except Exception as e:  # a sandbox without the 127.0.0.0/8 aliases cannot host this test
            pytest.fail(f"cannot start a ranking replica on {host}:{port}: {e}")

    aged, off = ConnectionAge(max_age_s=AGE_S), ConnectionAge(max_age_s=0)
    loads: list[Load] = []
    threads: list[threading.Thread] = []
    try:
        # The pair under test (a 3 s age) and the control (age off), side by side.
        first = ranking("127.0.0.1", 0, aged)
        ctl_first = ranking("127.0.0.3", first.port, off)
        zone.set("ranking.recpipe.test", ["127.0.0.1"])
        zone.set("control.recpipe.test", ["127.0.0.3"])
        gateways = [
            start(GatewayStage(serving_chain.features.address, serving_chain.retrieval.address,
                               f"dns://127.0.0.1:{dns_port}/{name}.recpipe.test:{first.port}"),
                  "127.0.0.1", 0, aged)
            for name in ("ranking", "control")
        ]
        gateway_started = time.monotonic()
        for gw in gateways:
            loads.append(Load(gw.address, dataset_info["num_users"]))
            threads.append(threading.Thread(target=loads[-1].run, daemon=True))
            threads[-1].start()
        while min(rank_calls(first), rank_calls(ctl_first)) < 5:  # both gateways serving through DNS
            assert time.monotonic() - gateway_started < 30, [ld.errors[-3:] for ld in loads]
            time.sleep(0.05)

        # Scale up: the new replicas are SERVING, then the names answer with both addresses.
        second = ranking("127.0.0.2", first.port, aged)
        ctl_second = ranking("127.0.0.4", first.port, off)
        zone.set("ranking.recpipe.test", ["127.0.0.1", "127.0.0.2"])
        zone.set("control.recpipe.test", ["127.0.0.3", "127.0.0.4"])
        added = time.monotonic()
        while rank_calls(second) == 0:
            assert time.monotonic() - added < DISCOVERY_TIMEOUT_S, "the gateway never used the new replica"
            time.sleep(0.02)
        found = time.monotonic()
        before = (rank_calls(first), rank_calls(second))
        time.sleep(3.0)  # then both replicas share the calls
        after = (rank_calls(first), rank_calls(second))
        control = rank_calls(ctl_second)
    finally:
        for ld in loads:
            ld.stop.set()
        for t in threads:
            t.join(timeout=15)
        for server in reversed(started):
            serving_threads.stop(server)

    lag, since_start = found - added, found - gateway_started
    print(f"\nnew replica's first Rank call {lag:.1f} s after DNS answered it "
          f"({since_start:.1f} s after the gateway started; max connection age {aged.max_age_s:g} s); "
          f"control (age off) replica 2: {control:.0f} Rank calls over {time.monotonic() - added:.1f} s; "
          f"Recommend calls: {loads[0].ok} ok, {len(loads[0].errors)} failed")
    assert not loads[0].errors, loads[0].errors[:3]  # no call failed across the GOAWAYs and reconnects
    assert not loads[1].errors, loads[1].errors[:3]
    assert after[0] > before[0] and after[1] > before[1], (before, after)  # round_robin over both
    assert control == 0, "without a connection age the gateway should not have re-resolved"
    # the name was resolved again after the scale-up, which is what found the replica
    assert any(name == "ranking.recpipe.test" and t > added for name, t in zone.queries)
