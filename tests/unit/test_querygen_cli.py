"""Bad querygen arguments: one line on stderr, exit code 2, and quickly (no server needed)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from cli_support import one_line_exit_2


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--mode", "open", "--rate", "0"], "--rate must be > 0"),
        (["--mode", "open", "--rate", "-3"], "--rate must be > 0"),
        (["--mode", "open"], "needs --rate"),
        (["--mode", "burst"], "unknown --mode 'burst'"),
        (["--rate", "10"], "--rate applies to --mode open"),
        (["--mode", "closed", "--concurrency", "0"], "--concurrency"),
        (["--duration", "0"], "--duration"),
        (["--duration", "1", "--queries", "5"], "not allowed with"),
        (["--users", "pareto"], "uniform or zipf"),
        (["--num-candidates", "0"], "--num-candidates"),
        (["--candidates-dist", "normal:1,2"], "lognormal:MEDIAN,SIGMA"),
        (["--candidates-file", "/nonexistent/q.txt"], "cannot read"),
        (["--mode", "closed", "--slo-p99-ms", "50"], "--mode open"),
        (["--mode", "open", "--rate", "10", "--processes", "0"], "--processes must be in 1..64"),
        (["--mode", "open", "--rate", "10", "--processes", "-2"], "--processes must be in 1..64"),
        (["--mode", "open", "--rate", "10", "--processes", "1000"], "--processes must be in 1..64"),
        (["--mode", "open", "--rate", "10", "--processes", "two"], "--processes must be a whole number or auto"),
        (["--mode", "open", "--rate", "10", "--processes", "1.5"], "--processes must be a whole number or auto"),
        (["--processes", "2"], "sequential sends one query at a time"),
        (["--mode", "closed", "--concurrency", "2", "--processes", "4"], "more than --concurrency 2"),
        (["--mode", "open", "--rate", "10", "--min-queries", "-1"], "--min-queries must be >= 0"),
        (["--min-queries", "100"], "use it with --mode open"),
        (["--mode", "open", "--rate", "10", "--queries", "50", "--min-queries", "100"],
         "give --queries or --min-queries"),
    ],
)
def test_bad_arguments(capsys: pytest.CaptureFixture[str], extra: list[str], match: str) -> None:
    one_line_exit_2(capsys, ["querygen", "--target", "127.0.0.1:1", *extra], match)


def test_missing_target(capsys: pytest.CaptureFixture[str]) -> None:
    one_line_exit_2(capsys, ["querygen", "--queries", "1"], "--target")


def test_unreachable_target_is_detected_within_5_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    one_line_exit_2(capsys, ["querygen", "--target", f"127.0.0.1:{_closed_port()}", "--queries", "1"],
                     "cannot reach")
    assert time.monotonic() - t0 < 5.0


def test_existing_output_is_refused_before_connecting(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    out.write_text("{}")
    one_line_exit_2(capsys, ["querygen", "--target", "127.0.0.1:1", "--out", str(out)], "--force")
    assert out.read_text() == "{}"


@pytest.mark.parametrize("rates", ["0", "abc", ","])
def test_bench_querygen_rejects_bad_rates(capsys: pytest.CaptureFixture[str], rates: str) -> None:
    one_line_exit_2(capsys, ["bench", "querygen", "--rates", rates], "--rates")



@pytest.mark.parametrize("processes", ["0", "auto", "1,x"])
def test_bench_querygen_rejects_bad_process_counts(capsys: pytest.CaptureFixture[str], processes: str) -> None:
    one_line_exit_2(capsys, ["bench", "querygen", "--processes", processes], "--processes")


def test_the_platform_block_records_the_grpc_experiments_a_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from recpipe.querygen import platform_info

    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    assert platform_info.detect()["grpc_experiments"] is None  # gRPC's defaults
    monkeypatch.setenv("GRPC_EXPERIMENTS", "-event_engine_client")  # changes gRPC's cost per call
    assert platform_info.detect()["grpc_experiments"] == "-event_engine_client"


def test_min_queries_lengthens_an_open_run_that_would_schedule_fewer() -> None:
    from recpipe.querygen.config import QuerygenConfig
    from recpipe.querygen.workload import fixed_candidates, open_schedule

    config = QuerygenConfig("127.0.0.1:1", "open", fixed_candidates(10), rate=10.0, duration=2.0, min_queries=50)
    assert config.window_s(10.0) == 5.0  # 2 s at 10 q/s is 20 queries: 5 s holds 50
    assert config.window_s(100.0) == 2.0  # 2 s at 100 q/s holds 200 already
    assert len(open_schedule(10.0, 0.0, config.window_s(10.0) or 0.0, 0)) == 50
    plain = QuerygenConfig("127.0.0.1:1", "open", fixed_candidates(10), rate=10.0, duration=2.0)
    assert plain.window_s(10.0) == 2.0
