"""querygen --processes N against the test server (a real gRPC server in its own process): one report
from N sender processes, with each one's send lag; a sender that dies or cannot connect is one line,
not a hang; Ctrl-C stops every sender."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recpipe.cli import main
from recpipe.errors import SenderFailed, UsageError
from recpipe.querygen import loops, senders
from recpipe.querygen import session as session_module
from recpipe.querygen.config import AUTO, QuerygenConfig
from recpipe.querygen.output import summary_text
from recpipe.querygen.session import Session
from recpipe.querygen.testserver import TestServerConfig, TestServerProcess
from recpipe.querygen.workload import fixed_candidates, open_schedule


@pytest.fixture(scope="module")
def server() -> Iterator[TestServerProcess]:
    with TestServerProcess(TestServerConfig({}, num_users=321)) as s:
        yield s


def _run(tmp_path: Path, name: str, *argv: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    assert main(["querygen", *argv, "--out", str(out), "--quiet"]) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def test_open_loop_from_two_processes_is_one_report_with_each_send_lag(
        server: TestServerProcess, tmp_path: Path) -> None:
    doc = _run(tmp_path, "open2", "--target", server.target, "--mode", "open", "--rate", "400", "--duration", "1",
               "--warmup", "0.2", "--seed", "3", "--processes", "2")
    # The whole seeded schedule was sent, split between the two: round(400 x 1) measured, 80 warm-up.
    assert doc["queries"] == 400 and doc["warmup_queries"] == 80 and doc["errors"] == 0
    assert doc["queries"] + doc["warmup_queries"] == len(open_schedule(400, 0.2, 1.0, 3))
    gen = doc["generator"]
    assert gen["processes"] == 2 and gen["processes_requested"] == 2 and gen["processes_reason"] == "--processes 2"
    rows = gen["senders"]
    assert [r["process"] for r in rows] == [0, 1]
    assert sorted(r["queries"] for r in rows) == [200, 200] and sum(r["warmup_queries"] for r in rows) == 80
    for r in rows:
        lag = r["send_lag"]
        assert lag["count"] == r["queries"] and 0 <= lag["p50_us"] <= lag["p99_us"] <= lag["max_us"]
        assert r["cpu_s"] > 0
    # one merged histogram: its counts are the senders' together
    assert doc["send_lag"]["count"] == 400 == doc["end_to_end"]["count"]
    assert doc["send_lag"]["max_us"] == max(r["send_lag"]["max_us"] for r in rows)
    # the queries' time by stage is merged too: the slowest 1% of all 400 are 4 queries
    assert doc["attribution"]["p99"]["queries"] == 4 and doc["attribution"]["median"]["queries"] == 40
    assert gen["sender_cpu_s"] == pytest.approx(sum(r["cpu_s"] for r in rows), abs=1e-5)
    assert 0 < gen["machine_busy"] <= 1  # the whole machine's share of busy cores over the run (/proc/stat)
    # the table says so too
    assert "senders: 2 processes (--processes 2); send lag per process (ms) 0: p50" in summary_text(doc)


def test_one_process_documents_itself_as_the_only_sender(server: TestServerProcess, tmp_path: Path) -> None:
    doc = _run(tmp_path, "open1", "--target", server.target, "--mode", "open", "--rate", "200", "--duration", "0.5",
               "--seed", "3")
    gen = doc["generator"]
    assert gen["processes"] == 1 and gen["sender_cpu_s"] == 0 and 0 < gen["machine_busy"] <= 1
    assert gen["senders"][0]["queries"] == doc["queries"] == 100


def test_closed_loop_divides_the_clients_and_the_queries(server: TestServerProcess, tmp_path: Path) -> None:
    doc = _run(tmp_path, "closed2", "--target", server.target, "--mode", "closed", "--concurrency", "3",
               "--queries", "101", "--processes", "2", "--per-component")
    assert doc["queries"] == 101 and doc["errors"] == 0 and doc["concurrency"] == 3
    assert sorted(r["queries"] for r in doc["generator"]["senders"]) == [50, 51]
    assert doc["stages"]["rank"]["count"] == 101  # timed from the client, in each sender
    per = ", ".join(str(r["queries"]) for r in doc["generator"]["senders"])
    assert f"senders: 2 processes (--processes 2); queries per process {per}" in summary_text(doc)


def test_auto_adds_senders_as_the_rate_rises(server: TestServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_module, "usable_cores", lambda: 4)
    config = QuerygenConfig(target=server.target, mode="open", candidates=fixed_candidates(50), rate=100.0,
                            duration=0.3, num_users=100, processes=AUTO)

    async def steps() -> list[tuple[int, int, str]]:
        session = Session(config)
        await session.open()
        try:
            out = []
            for rate in (0.5 * senders.PROCESS_RATE, 1.5 * senders.PROCESS_RATE):
                step = await session.measure(rate)
                out.append((len(step.senders), step.measurement.queries, step.processes_reason))
            return out
        finally:
            await session.close()

    (n1, q1, why1), (n2, q2, why2) = loops.run(steps())
    assert (n1, q1) == (1, 150) and why1.startswith("auto: 500 q/s")
    assert (n2, q2) == (2, 450) and why2.startswith("auto: 1500 q/s")


def _pool_config(target: str) -> QuerygenConfig:
    return QuerygenConfig(target=target, mode="open", candidates=fixed_candidates(10), rate=100.0, duration=0.5,
                          num_users=10, processes=2, connect_timeout=2.0)


def test_a_sender_that_dies_is_named_in_one_line(server: TestServerProcess) -> None:
    async def go() -> None:
        pool = senders.SenderPool(_pool_config(server.target), 10)
        try:
            await pool.grow(2)
            pid = pool.pids[1]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            arrivals = open_schedule(100.0, 0.0, 0.5, 0)
            await pool.measure([senders.open_job(arrivals, 0.0, k, 2) for k in range(2)])
        finally:
            pool.close()

    t0 = time.monotonic()
    with pytest.raises(SenderFailed, match=r"^sender process 1 of 2 was killed by signal 9 before it reported$"):
        loops.run(go())
    assert time.monotonic() - t0 < 30


def test_a_sender_that_cannot_connect_is_a_usage_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"

    async def go() -> None:
        pool = senders.SenderPool(_pool_config(closed), 10)
        try:
            await pool.grow(2)
        finally:
            pool.close()

    with pytest.raises(UsageError, match=r"^sender process [01] of 2: cannot reach 127\.0\.0\.1:\d+") as e:
        loops.run(go())
    assert "\n" not in str(e.value)


def _alive(pid: int) -> bool:
    """Running (a zombie that nobody has reaped yet has stopped running too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.add(int(entry.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_stops_every_sender(server: TestServerProcess) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "recpipe", "querygen", "--target", server.target, "--mode",
                             "open", "--rate", "100", "--duration", "60", "--processes", "2", "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        kids: set[int] = set()
        # the two senders (and multiprocessing's resource tracker) are up once the run is under way
        while len(kids) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            kids = _children(proc.pid)
        assert len(kids) >= 3, kids
        time.sleep(1.0)  # into the measurement
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert err.strip().splitlines()[-1] == "recpipe: interrupted", err
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [k for k in kids if _alive(k)]
        assert not left, left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_run_on_a_saturated_machine_says_its_latencies_include_waiting_for_a_cpu(
        server: TestServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recpipe.cputime import MachineTicks

    readings = iter(range(1, 1000))  # each reading 100 jiffies later, 99 of them busy: a saturated machine
    monkeypatch.setattr(session_module.cputime, "machine_ticks",
                        lambda: MachineTicks(99 * (k := next(readings)), 0, 100 * k))
    doc = _run(tmp_path, "busy", "--target", server.target, "--mode", "closed", "--concurrency", "2",
               "--queries", "20")
    assert doc["generator"]["machine_busy"] == 0.99
    assert any(w.startswith("the machine was 99% busy (all cores) during the run: the generator shared saturated "
                            "cores") for w in doc["warnings"]), doc["warnings"]
    monkeypatch.undo()
    calm = _run(tmp_path, "calm", "--target", server.target, "--mode", "closed", "--concurrency", "1", "--queries", "20")
    assert not any(w.startswith("the machine was") for w in calm["warnings"]) or calm["generator"]["machine_busy"] >= 0.95
    from recpipe.querygen.recorder import Recorder

    def step(busy: int, total: int) -> session_module.Step:
        span = (MachineTicks(0, 0, 0), MachineTicks(busy, 0, total))
        return session_module.Step(Recorder(0.0).finish(), None, [], "", span)

    # over two steps: (97 + 60) busy of (100 + 100)
    assert session_module.machine_busy([step(97, 100), step(60, 100)]) == 0.785
    assert session_module.machine_busy([step(97, 100)]) == 0.97 >= session_module.cputime.SATURATED
    unread = session_module.Step(Recorder(0.0).finish(), None, [], "")
    assert session_module.machine_busy([step(97, 100), unread]) is None  # /proc/stat unreadable: unknown
