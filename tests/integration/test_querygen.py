"""The query generator against its test server (a real gRPC server in its own process, port 0).

The server's delays and stalls are known, so these tests check the instrument itself: that a 5 ms stage
reads as 5 ms, that an open loop delivers its rate, and that a server stall shows in the open loop's
tail but is largely hidden by a closed loop (coordinated omission).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recpipe.cli import main
from recpipe.config import STEPS
from recpipe.querygen.testserver import TestServerConfig, TestServerProcess

DELAY_US = 5000.0


#: HdrHistogram keeps 3 significant digits: a recorded 5,000 µs may read back up to 0.1% lower
AT_LEAST_DELAY_US = DELAY_US * 0.999


@pytest.fixture(scope="module")
def rank_5ms() -> Iterator[TestServerProcess]:
    """rank takes 5 ms, the other stages nothing; SIGUSR1 freezes it for 200 ms."""
    with TestServerProcess(TestServerConfig({"rank": DELAY_US / 1e6}, num_users=321, stall_for=0.2)) as s:
        yield s


@pytest.fixture(scope="module")
def no_delay() -> Iterator[TestServerProcess]:
    with TestServerProcess(TestServerConfig({}, num_users=321)) as s:
        yield s


def _run(tmp_path: Path, name: str, *argv: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    t0 = time.perf_counter()
    assert main(["querygen", *argv, "--out", str(out), "--quiet"]) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    doc["_test_elapsed_us"] = (time.perf_counter() - t0) * 1e6
    return doc


def _check_sequential_timings(doc: dict[str, Any], slow: str) -> None:
    """Order, not speed: every sample holds the delay, so nothing reads under it; the delay shows in
    ``slow`` and no other stage; per query server <= observed <= end to end; and one query after the
    other, the recorded times fit in the time the test saw the run take (catches a unit slip)."""
    stage = doc["stages"][slow]
    assert stage["min_us"] >= AT_LEAST_DELAY_US and stage["server"]["min_us"] >= AT_LEAST_DELAY_US
    assert stage["server"]["p50_us"] <= stage["p50_us"] <= doc["end_to_end"]["p50_us"]
    assert all(doc["stages"][s]["server"]["p50_us"] < AT_LEAST_DELAY_US for s in STEPS if s != slow)
    assert doc["end_to_end"]["mean_us"] * doc["queries"] <= doc["_test_elapsed_us"]


def test_sequential_run_document_and_charts(rank_5ms: TestServerProcess, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    plots = tmp_path / "plots"
    out = tmp_path / "run.json"
    rc = main(["querygen", "--target", rank_5ms.target, "--mode", "sequential", "--queries", "60",
               "--candidates-dist", "lognormal:200,0.5", "--users", "zipf", "--out", str(out),
               "--plot", str(plots)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "recpipe.querygen.run" and doc["format_version"] == 1
    assert doc["mode"] == "sequential" and doc["target_rate"] is None
    assert doc["queries"] == 60 and doc["ok"] == 60 and doc["errors"] == 0 and doc["errors_by_code"] == {}
    assert doc["achieved_rate"] > 0
    assert doc["platform"]["cpu"] and doc["platform"]["gpu"] and doc["platform"]["cores"] >= 1
    assert doc["workload"]["num_users"] == 321 and "gateway" in doc["workload"]["num_users_source"]
    assert doc["model_version"] == "testserver"
    keys = {"p50_us", "p90_us", "p95_us", "p99_us", "p999_us", "max_us", "mean_us"}
    assert keys <= set(doc["end_to_end"])
    assert set(doc["stages"]) == set(STEPS)
    for stage in STEPS:
        assert keys <= set(doc["stages"][stage]) and keys <= set(doc["stages"][stage]["server"])
        assert doc["stages"][stage]["count"] == 60
    assert sorted(p.name for p in plots.iterdir()) == ["latency_cdf.png", "stage_latency.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots.iterdir())
    table = capsys.readouterr().out
    assert "end to end" in table and "rank" in table
    # Never overwritten without --force.
    assert main(["querygen", "--target", rank_5ms.target, "--queries", "5", "--out", str(out)]) == 2


def test_fixed_5ms_stage_is_measured_within_5_percent(rank_5ms: TestServerProcess, no_delay: TestServerProcess,
                                                      tmp_path: Path) -> None:
    doc = _run(tmp_path, "gw", "--target", rank_5ms.target, "--queries", "100", "--warmup", "0.2")
    assert doc["queries"] == 100 and doc["errors"] == 0
    _check_sequential_timings(doc, "rank")
    # Client-side timing (--per-component): the client times each call itself; the same checks hold,
    # and the call to the delayed server reads slower than the same call to one without the delay.
    slow = _run(tmp_path, "pc5", "--per-component", "--target", rank_5ms.target, "--queries", "100",
                "--warmup", "0.2")
    fast = _run(tmp_path, "pc0", "--per-component", "--target", no_delay.target, "--queries", "100",
                "--warmup", "0.2")
    assert slow["per_component"] and slow["queries"] == 100 and slow["errors"] == 0
    _check_sequential_timings(slow, "rank")
    assert fast["stages"]["rank"]["server"]["p50_us"] < AT_LEAST_DELAY_US <= slow["stages"]["rank"]["min_us"]


@pytest.mark.slow
def test_open_loop_achieves_its_rate(no_delay: TestServerProcess, tmp_path: Path) -> None:
    doc = _run(tmp_path, "open", "--target", no_delay.target, "--mode", "open", "--rate", "200",
               "--duration", "4", "--seed", "11")
    assert doc["mode"] == "open" and doc["target_rate"] == 200
    # Arrivals follow the schedule, not the answers: the count is rate x duration whatever the latency.
    assert doc["queries"] == pytest.approx(800, abs=2) and doc["errors"] == 0
    assert doc["achieved_rate"] > 0
    assert doc["send_lag"]["count"] == doc["queries"]


def _with_stall(server: TestServerProcess, after_s: float) -> threading.Timer:
    timer = threading.Timer(after_s, server.stall)
    timer.start()
    return timer


@pytest.mark.slow
def test_a_stall_shows_in_the_open_loop_tail_and_hides_in_the_closed_loop(
        rank_5ms: TestServerProcess, tmp_path: Path) -> None:
    timer = _with_stall(rank_5ms, 1.6)
    open_ = _run(tmp_path, "open", "--target", rank_5ms.target, "--mode", "open", "--rate", "200",
                 "--duration", "3", "--warmup", "0.5")
    timer.join()
    timer = _with_stall(rank_5ms, 1.6)
    closed = _run(tmp_path, "closed", "--target", rank_5ms.target, "--mode", "closed", "--concurrency", "1",
                  "--duration", "3", "--warmup", "0.5")
    timer.join()
    # Open loop: the ~40 queries due during the 200 ms freeze all wait it out, from their scheduled time.
    assert open_["end_to_end"]["max_us"] >= 180_000
    assert open_["end_to_end"]["p999_us"] >= 150_000
    assert open_["end_to_end"]["p99_us"] >= 80_000
    # Closed loop: the one client waits once, and sends nothing while it waits: the stall is one sample
    # of ~400, seen in the max but not at p99.
    assert closed["end_to_end"]["max_us"] >= 180_000
    assert closed["end_to_end"]["p99_us"] < open_["end_to_end"]["p99_us"]


@pytest.mark.slow
def test_slo_search_finds_the_knee_of_a_serial_server(tmp_path: Path) -> None:
    # One query at a time at 10 ms each: capacity 100 q/s (less the RPC's own cost). Past it the queue
    # grows without bound, so the search must settle below ~100 q/s.
    with TestServerProcess(TestServerConfig({"rank": 0.010}, serial=True)) as server:
        plots = tmp_path / "plots"
        out = tmp_path / "slo.json"
        assert main(["querygen", "--target", server.target, "--mode", "open", "--rate", "25",
                     "--slo-p99-ms", "150", "--duration", "1", "--out", str(out), "--plot", str(plots),
                     "--quiet"]) == 0
    doc = json.loads(out.read_text())
    slo = doc["slo"]
    assert slo["max_rate"] is not None and 25 <= slo["max_rate"] <= 110
    curve = {c["target_rate"]: c for c in slo["curve"]}
    assert list(curve) == sorted(curve) and len(curve) >= 4
    failing = [r for r, c in curve.items() if not c["meets_slo"]]
    assert curve[25]["meets_slo"] and failing and min(failing) <= 200
    assert all(r > slo["max_rate"] for r in failing)
    assert doc["target_rate"] == slo["max_rate"]
    assert (plots / "slo_curve.png").exists()
    # 1-s steps at these rates answer far fewer than 1,000 queries: the document says their p99s are thin
    assert slo["min_queries"] == 0
    assert any(w.startswith(f"{len(curve)} of {len(curve)} SLO steps answered fewer than 1,000 queries")
               for w in doc["warnings"]), doc["warnings"]


def test_min_queries_runs_each_slo_step_until_it_has_sent_that_many(tmp_path: Path) -> None:
    # --duration 0.2 at 50 q/s would be 10 queries a step; --min-queries 40 makes it 0.8 s and 40
    with TestServerProcess(TestServerConfig({})) as server:
        slo = _run(tmp_path, "minq", "--target", server.target, "--mode", "open", "--rate", "50",
                   "--slo-p99-ms", "1000", "--duration", "0.2", "--min-queries", "40")
        plain = _run(tmp_path, "plain", "--target", server.target, "--mode", "open", "--rate", "50",
                     "--duration", "0.2")
    curve = slo["slo"]["curve"]
    assert slo["slo"]["min_queries"] == slo["workload"]["min_queries"] == 40
    assert curve[0]["target_rate"] == 50 and curve[0]["queries"] == 40
    # each step at least 40, and exactly its rate's share where 0.2 s holds more
    assert all(c["queries"] == max(40, round(c["target_rate"] * 0.2)) for c in curve), curve
    assert plain["queries"] == 10 and plain["workload"]["min_queries"] == 0


@pytest.mark.parametrize("server", ["frames", "aio"])
def test_bench_querygen_prints_naive_beside_fast(capsys: pytest.CaptureFixture[str], server: str) -> None:
    assert main(["bench", "querygen", "--rates", "200", "--duration", "0.5", "--warmup", "0.1", "--json",
                 "--server", server]) == 0
    out = capsys.readouterr().out
    assert ("at the HTTP/2 frame level" if server == "frames" else "the grpc.aio fixed-reply server") in out
    assert "naive (asyncio epoll)" in out and "recpipe (select)" in out
    assert "200 q/s: send lag p99 naive" in out
    # one and two sender processes side by side, each sending the whole schedule
    assert "200 q/s: sender processes -> achieved 1: " in out and ", 2: " in out
    rows = json.loads(out[out.index("\n["):])
    assert sorted((r["loop"], r["processes"]) for r in rows) == [
        ("naive (asyncio epoll)", 1), ("recpipe (select)", 1), ("recpipe (select)", 2)]
    assert {r["queries"] for r in rows} == {100} and all(r["errors"] == 0 for r in rows)
    # the whole machine's CPU over each run: busy part of the time, and no less than the generator's (the
    # counters tick in hundredths of a second per core, so each end of a run may be a tick per core out:
    # against the frame-level target's few us per query that is most of a 0.6-s run's margin)
    tick_slack_us = 2 * (os.cpu_count() or 1) * 10_000 / 120  # 120 queries sent a run, warm-up included
    for r in rows:
        assert 0 < r["machine_busy"] <= 1, r
        assert r["machine_cpu_us_per_query"] >= 0.8 * r["generator_cpu_us_per_query"] - tick_slack_us, r


def test_bench_querygen_says_whether_the_generator_or_the_machine_was_the_limit() -> None:
    from recpipe.bench.querygen import _machine_line

    line = _machine_line({1: {"machine_busy": 0.52, "machine_cpu_us_per_query": 600.0},
                          2: {"machine_busy": 0.99, "machine_cpu_us_per_query": 690.0,
                              "generator_cpu_us_per_query": 350.0, "server_cpu_us_per_query": 172.0}})
    assert line == ("the whole machine (all cores, /proc/stat): 1 process 52% busy (the generator was the limit), "
                    "2 processes 99% busy (the machine was the limit: 690 us of its CPU per query, 168 of them "
                    "outside generator and target)")
    assert _machine_line({1: {}, 2: {}}).endswith("not readable here")
