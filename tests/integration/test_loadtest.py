"""`locust -f loadtest/` as users run it (a subprocess), against real gRPC servers.

Most tests use a small grpc.aio RecommendService in its own process whose answers are under the
test's control (known stage times, NOT_FOUND past a known user count), so they can check what locust
records, not just that it ran. The last ones run against the real chain from tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from locust_stats import final_stats

from recpipe.config import STEPS, TOTAL_STEP
from recpipe.v1 import recommend_pb2, recommend_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
LOADTEST = ROOT / "loadtest"
STAGE_ROWS = [f"stage:{s}" for s in STEPS]
#: server_us the fake reports per stage: distinct, so a mixed-up row would show
FAKE_SERVER_US = {"augment_user": 1_000, "retrieve": 3_000, "augment_items": 5_000, "rank": 7_000}
FAKE_USERS = 37


class FakeGateway(recommend_pb2_grpc.RecommendServiceServicer):
    """Answers like the gateway: fixed stage timings, NOT_FOUND for user ids >= num_users."""

    def __init__(self, num_users: int, delay_s: float) -> None:
        self.num_users = num_users
        self.delay_s = delay_s

    async def Recommend(self, request, context):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if not 0 <= request.user_id < self.num_users:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown user {request.user_id}")
        # rank reports its batcher's split (a quarter queued, batches of 4); the others do not (zeros)
        timings = [
            recommend_pb2.StageTiming(stage=s, server_us=us, observed_us=us + 200,
                                      **({"queue_us": us // 4, "compute_us": us - us // 4, "batch_size": 4}
                                         if s == "rank" else {}))
            for s, us in FAKE_SERVER_US.items()
        ]
        timings.append(recommend_pb2.StageTiming(stage=TOTAL_STEP, server_us=17_000, observed_us=17_000))
        n = request.num_results or 10
        return recommend_pb2.RecommendResponse(
            item_ids=list(range(n)), scores=[1.0 - i / n for i in range(n)], timings=timings, model_version="fake"
        )


async def _serve_fake(delay_s: float) -> None:
    server = grpc.aio.server()
    recommend_pb2_grpc.add_RecommendServiceServicer_to_server(FakeGateway(FAKE_USERS, delay_s), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


@contextlib.contextmanager
def fake_gateway_process(delay_s: float = 0.0) -> Iterator[int]:
    """The fake gateway in its own process (as the real one is), so locust's load does not share
    the test process's GIL; yields its port."""
    proc = subprocess.Popen([sys.executable, __file__, str(delay_s)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"fake gateway did not start: {line!r}"
        yield int(line)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def fake_port() -> Iterator[int]:
    with fake_gateway_process() as port:
        yield port


def run_locust(
    out: Path, host: str | None, *args: str, env: dict[str, str] | None = None, users: int = 4,
    run_time: str = "5s",
) -> subprocess.CompletedProcess[str]:
    """``locust -f loadtest/ --headless`` as a user types it; returns the finished process."""
    cmd = [sys.executable, "-m", "locust", "-f", str(LOADTEST), "--headless",
           "-u", str(users), "-r", str(users), "--csv", str(out / "run"), "--only-summary", *args]
    if host is not None:
        cmd += ["--host", host]
    if run_time:
        cmd += ["-t", run_time]
    # only the settings this test names: none inherited from the shell running pytest
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("RECPIPE_", "LOCUST_"))}
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=out, env=full_env, capture_output=True, text=True, timeout=120)
    (out / "stderr.txt").write_text(proc.stderr)
    return proc


def read_stats(out: Path) -> dict[str, dict[str, str]]:
    """The final rows by name, with the CSV's column names, from the summary printed at exit, not from
    ``_stats.csv``: locust rewrites that about once a second while running and not at exit, so on a busy
    machine it trails the run (see locust_stats.py). Times are whole units, as printed."""
    return final_stats((out / "stderr.txt").read_text())


def user_counts(out: Path) -> list[int]:
    """The running user count, about once a second, from ``_stats_history.csv``."""
    with open(out / "run_stats_history.csv", newline="") as f:
        return [int(r["User Count"]) for r in csv.DictReader(f) if r["Name"] == "Aggregated"]


def read_failures(out: Path) -> list[dict[str, str]]:
    with open(out / "run_failures.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_every_stage_is_its_own_row_timed_by_server_us(tmp_path: Path, fake_port: int) -> None:
    proc = run_locust(tmp_path, f"grpc://127.0.0.1:{fake_port}", "--num-user-ids", str(FAKE_USERS), run_time="2s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = read_stats(tmp_path)
    calls = int(stats["Recommend"]["Request Count"])
    assert calls > 0
    for stage, name in zip(STEPS, STAGE_ROWS, strict=True):
        row = stats[name]
        assert row["Type"] == "stage_us"
        # one stage sample per successful call, and its time is the server_us the gateway reported, in
        # microseconds: sub-millisecond resolution survives locust's whole-unit percentiles
        assert int(row["Request Count"]) == calls
        assert int(row["Failure Count"]) == 0
        assert float(row["Average Response Time"]) == pytest.approx(FAKE_SERVER_US[stage], rel=1e-6)
        assert int(row["50%"]) == FAKE_SERVER_US[stage]
    # the queue/compute split, only for the stage that reports it
    assert float(stats["stage:rank queue"]["Average Response Time"]) == FAKE_SERVER_US["rank"] // 4
    assert int(stats["stage:rank compute"]["Request Count"]) == calls
    assert "stage:retrieve queue" not in stats
    # the Aggregated row counts Recommend calls only, not stage samples
    assert int(stats["Aggregated"]["Request Count"]) == calls
    assert int(stats["Recommend"]["Failure Count"]) == 0
    assert stats["Recommend"]["Type"] == "grpc"
    # the step shape in the same directory stays off: -u decides the user count
    assert max(user_counts(tmp_path)) == 4


def test_observed_stage_time_and_target_from_the_environment(tmp_path: Path, fake_port: int) -> None:
    proc = run_locust(tmp_path, None, "--num-user-ids", str(FAKE_USERS), users=2, run_time="2s",
                      env={"RECPIPE_TARGET": f"grpc://127.0.0.1:{fake_port}", "RECPIPE_STAGE_TIME": "observed"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = read_stats(tmp_path)
    assert int(stats["Recommend"]["Request Count"]) > 0
    assert float(stats["stage:rank"]["Average Response Time"]) == pytest.approx(7200, rel=1e-6)


def test_grpc_errors_are_failures_named_by_status_code(tmp_path: Path, fake_port: int) -> None:
    # ten times more user ids than the service knows: most calls are NOT_FOUND
    proc = run_locust(tmp_path, f"127.0.0.1:{fake_port}", "--num-user-ids", str(10 * FAKE_USERS),
                      users=2, run_time="2s")
    assert proc.returncode == 1, "locust exits 1 when any request failed"
    stats = read_stats(tmp_path)
    calls, failed = int(stats["Recommend"]["Request Count"]), int(stats["Recommend"]["Failure Count"])
    assert 0 < failed < calls
    # a failed call has no response, so no stage rows: stage counts equal the successful calls
    assert int(stats["stage:rank"]["Request Count"]) == calls - failed
    errors = [r for r in read_failures(tmp_path) if r["Name"] == "Recommend"]
    assert errors and all("NOT_FOUND" in r["Error"] for r in errors), errors


def test_user_count_is_found_by_asking_the_gateway(tmp_path: Path, fake_port: int) -> None:
    proc = run_locust(tmp_path, f"127.0.0.1:{fake_port}", "--user-dist", "zipf", users=2, run_time="2s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{FAKE_USERS} users found by asking" in proc.stderr
    stats = read_stats(tmp_path)
    assert int(stats["Recommend"]["Request Count"]) > 0 and int(stats["Recommend"]["Failure Count"]) == 0


def test_step_shape_ramps_when_selected(tmp_path: Path, fake_port: int) -> None:
    args = ["--num-user-ids", str(FAKE_USERS), "--step-users", "2", "--step-time", "1.5"]
    proc = run_locust(tmp_path, f"127.0.0.1:{fake_port}", *args,
                      env={"RECPIPE_SHAPE": "step"}, users=4, run_time="")
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = user_counts(tmp_path)
    # 2 then 4 users, never above -u, and the shape ends the run by itself (no -t given)
    assert max(counts) == 4 and 2 in counts, counts
    assert counts == sorted(counts), counts


def test_users_run_concurrently_under_gevent(tmp_path: Path) -> None:
    # Without grpc's gevent integration a blocking call stalls the whole locust process, and 4 users
    # send one request at a time: 1 / delay = 10 per second at most (measured: ~9.5). With it, ~4x that.
    with fake_gateway_process(delay_s=0.1) as port:
        proc = run_locust(tmp_path, f"127.0.0.1:{port}", "--num-user-ids", str(FAKE_USERS),
                          users=4, run_time="4s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rate = float(read_stats(tmp_path)["Recommend"]["Requests/s"])
    assert rate > 2 * (1 / 0.1), rate


def test_unreachable_gateway_ends_the_run_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_locust(tmp_path, f"127.0.0.1:{port}", users=2, run_time="")  # no -t: must stop by itself
    assert proc.returncode == 2
    assert "is the gateway up?" in proc.stderr and "UNAVAILABLE" in proc.stderr


if __name__ == "__main__":
    asyncio.run(_serve_fake(float(sys.argv[1])))


# --- against the real chain (tests/conftest.py: real stages over a tiny dataset and model repository) ---


def test_locust_against_the_real_chain(tmp_path: Path, serving_chain, dataset_info: dict[str, int]) -> None:
    # the README's command, as is: no user settings, so the user count is asked of the gateway
    proc = run_locust(tmp_path, serving_chain.gateway.address, users=4, run_time="3s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{dataset_info['num_users']} users found by asking" in proc.stderr
    stats = read_stats(tmp_path)
    for name in ["Recommend", *STAGE_ROWS]:
        assert int(stats[name]["Request Count"]) > 0, name
        assert int(stats[name]["Failure Count"]) == 0, name
    assert read_failures(tmp_path) == []
    # time inside the four stages' servers (rows in microseconds) is part of what the client waited for
    inside = sum(float(stats[name]["Average Response Time"]) for name in STAGE_ROWS) / 1000
    assert 0 < inside <= float(stats["Recommend"]["Average Response Time"])


def test_zipf_users_by_activity_against_the_real_chain(
    tmp_path: Path, serving_chain, small_dataset: Path
) -> None:
    proc = run_locust(tmp_path, serving_chain.gateway.address, users=2, run_time="2s",
                      env={"RECPIPE_USER_DIST": "zipf", "RECPIPE_DATA": str(small_dataset)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weighted by interactions" in proc.stderr
    stats = read_stats(tmp_path)
    assert int(stats["stage:rank"]["Request Count"]) > 0 and int(stats["Recommend"]["Failure Count"]) == 0
