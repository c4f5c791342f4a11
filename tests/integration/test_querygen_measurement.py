"""The instrument's newer parts against the controllable test server (recpipe/querygen/testserver.py,
its own process, port 0): the stability loop, the queue/compute split, replayed arrivals, the share of
late sends, the per-stage table, and the one-line CLI errors for the new flags."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recpipe.cli import main
from recpipe.config import STEPS
from recpipe.querygen.testserver import TestServerConfig, TestServerProcess


@pytest.fixture(scope="module")
def server() -> Iterator[TestServerProcess]:
    """rank: 1 ms queued, then 3 ms of compute (reported as queue_us / compute_us, batch_size 1)."""
    with TestServerProcess(TestServerConfig({"rank": 0.003}, num_users=50, queue_delays={"rank": 0.001})) as s:
        yield s


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "run.json"
    assert main(["querygen", *argv, "--out", str(out), "--force"]) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc, capsys.readouterr().out


def test_queue_compute_split_in_json_and_table(server: TestServerProcess, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # ":PORT" is 127.0.0.1:PORT
    doc, out = _run(tmp_path, capsys, "--target", f":{server.port}", "--queries", "40")
    assert doc["target"] == f"127.0.0.1:{server.port}"
    rank = doc["stages"]["rank"]
    assert rank["batch_size"] == {"count": 40, "mean": 1.0, "max": 1}
    assert 900 <= rank["queue"]["p50_us"] <= 1600 and 2900 <= rank["compute"]["p50_us"] <= 3700
    assert rank["queue"]["p50_us"] + rank["compute"]["p50_us"] <= rank["server"]["p50_us"] + 100
    for stage in STEPS:
        assert set(doc["stages"][stage]["queue"]) >= {"count", "p50_us", "p99_us", "mean_us"}
    lines = out.splitlines()
    assert lines[0].startswith("recpipe querygen: mode sequential") and "40 queries" in lines[0]
    assert re.match(r"machine: .+, \d+ cores, GPU .+ \| gateway cpu 1 thread$", lines[1]), lines[1]
    header = lines[2].split("  ")
    cells = [c.strip() for c in header if c.strip()]
    assert cells == ["stage", "time", "p50 (ms)", "p90 (ms)", "p99 (ms)", "p99.9 (ms)", "max (ms)", "mean (ms)",
                     "batch (mean)"]
    kinds = [line.split()[1] if line.startswith("rank") else line.split()[0] for line in lines[4:]
             if line.startswith(("rank", "   "))]
    assert kinds[-4:] == ["observed", "server", "queue", "compute"]
    assert "warning: p99 needs at least 100 samples, this run has 40" in out
    assert any(line.startswith("legend: server = time inside") for line in lines)


def test_stability_loop_stops_when_three_windows_agree(server: TestServerProcess, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    doc, out = _run(tmp_path, capsys, "--target", server.target, "--queries", "30", "--stability-percent", "50",
                    "--stability-percentile", "50")
    stab = doc["stability"]
    assert stab["stable"] and stab["percent"] == 50 and stab["percentile"] == 50 and stab["merged_windows"] == 3
    assert 3 <= len(stab["windows"]) <= 10
    assert [w["window"] for w in stab["windows"]] == list(range(1, len(stab["windows"]) + 1))
    assert all(w["queries"] == 30 for w in stab["windows"])
    # the result merges the last three windows
    assert doc["queries"] == 90 and doc["stages"]["rank"]["count"] == 90
    assert "stability: stable within 50% on p50 after" in out


def test_stability_loop_gives_up_on_a_server_that_never_settles(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # Blocks of 20 queries alternate between 4 ms and 16 ms: windows of 20 never agree within 10%.
    with TestServerProcess(TestServerConfig({"rank": 0.004}, alternate_every=20)) as s:
        doc, out = _run(tmp_path, capsys, "--target", s.target, "--queries", "20", "--stability-percent", "10",
                        "--stability-percentile", "50", "--max-windows", "4")
    stab = doc["stability"]
    assert not stab["stable"] and len(stab["windows"]) == 4
    values = [w["value_us"] for w in stab["windows"]]
    assert values[1] > 2.5 * values[0] and values[3] > 2.5 * values[2]
    assert any(w.startswith("not stable: the last 3 of 4 windows disagree") for w in doc["warnings"])
    assert "stability: NOT stable" in out


def test_arrivals_file_is_replayed_and_late_sends_counted(server: TestServerProcess, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    intervals = tmp_path / "intervals.txt"
    intervals.write_text("# microseconds between arrivals\n20000\n\n40000\n30000  # a comment\n")
    doc, out = _run(tmp_path, capsys, "--target", server.target, "--mode", "open", "--arrivals-file",
                    str(intervals), "--queries", "12")
    assert doc["workload"]["arrivals"] == {"file": str(intervals), "intervals": 3, "mean_rate": 33.333}
    assert doc["target_rate"] == pytest.approx(33.333, abs=0.001) and doc["queries"] == 12
    lag = doc["send_lag"]
    assert lag["count"] == 12 and 0 <= lag["late_over_1ms"] <= 12
    assert lag["late_share"] == pytest.approx(lag["late_over_1ms"] / 12, abs=1e-6)
    assert "sent more than 1 ms late" in out


def test_arrival_schedule_replays_the_intervals_in_order() -> None:
    from recpipe.querygen.workload import ArrivalIntervals

    arr = ArrivalIntervals((0.02, 0.04, 0.03))
    assert arr.schedule(0.0, None, 5) == pytest.approx([0.02, 0.06, 0.09, 0.11, 0.15])
    # a warm-up keeps its arrivals, and the measured ones follow it: 0.5 s more at 33.3 q/s
    times = arr.schedule(0.1, 0.5, None)
    assert times[:3] == pytest.approx([0.02, 0.06, 0.09]) and times[-1] < 0.6
    assert len(times[times >= 0.1]) == pytest.approx(0.5 * arr.mean_rate, abs=1)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--stability-percent", "0"], "--stability-percent must be > 0"),
        (["--stability-percent", "5", "--max-windows", "2"], "--max-windows must be >= 3"),
        (["--stability-percent", "5", "--stability-percentile", "100"], "--stability-percentile"),
        (["--mode", "open", "--rate", "5", "--slo-p99-ms", "9", "--stability-percent", "5"], "not with --slo-p99-ms"),
        (["--arrivals-file", "ARR"], "use it with --mode open"),
        (["--mode", "open", "--rate", "5", "--arrivals-file", "ARR"], "not both"),
        (["--mode", "open", "--arrivals-file", "BAD"], "intervals must be > 0 microseconds"),
        (["--mode", "open", "--arrivals-file", "/nonexistent/a.txt"], "cannot read"),
    ],
)
def test_new_flags_fail_in_one_line_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 extra: list[str], match: str) -> None:
    (tmp_path / "arr.txt").write_text("1000\n")
    (tmp_path / "bad.txt").write_text("1000\n-5\n")
    extra = [str(tmp_path / "arr.txt") if e == "ARR" else str(tmp_path / "bad.txt") if e == "BAD" else e
             for e in extra]
    assert main(["querygen", "--target", "127.0.0.1:1", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recpipe: error:") and match in err[0], err


def test_cannot_reach_states_the_time_it_waited(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["querygen", "--target", f":{port}", "--queries", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    m = re.search(rf"cannot reach 127\.0\.0\.1:{port}: connection failed after (\d+\.\d\d) s \(limit 4 s\)", err[0])
    assert m and float(m.group(1)) < 4.0, err[0]
