"""``recpipe serve`` as users run it: ``--stage all`` as a real process tree over the shared tiny model
repository; ``recpipe recommend`` against it; a killed stage is restarted; SIGTERM stops everything."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from recpipe.cli import main
from recpipe.client import RecommendClient
from recpipe.errors import StageUnavailable


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Lines:
    """A process's output, line by line, readable with a timeout."""

    def __init__(self, stream) -> None:
        self.q: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.q.put(line)

    def until(self, predicate, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=0.2)
            except queue.Empty:
                continue
            self.seen.append(line)
            if predicate(line):
                return line
        raise AssertionError(f"not seen within {timeout}s; got:\n{''.join(self.seen)}")


@pytest.fixture(scope="module")
def served(small_models, small_dataset):
    proc = subprocess.Popen(
        [sys.executable, "-m", "recpipe", "--log-level", "WARNING", "serve", "--models", str(small_models),
         "--data", str(small_dataset), "--port", "0", "--threads", "1", "--grace", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = Lines(proc.stdout)
    try:
        lines.until(lambda s: s.startswith("recpipe serving"), timeout=120)
        stages = {}
        names = ("gateway", "features", "retrieval", "ranking")

        def stage_row(line: str) -> bool:  # "NAME  HOST:PORT  PID  DEVICE  THREADS  METRICS"
            w = line.split()
            return len(w) >= 3 and w[0] in names and ":" in w[1] and w[2].isdigit()

        lines.until(lambda s: s.startswith("machine: "), timeout=5)
        for _ in range(4):
            parts = lines.until(stage_row, timeout=5).split()
            stages[parts[0]] = {"address": parts[1], "pid": int(parts[2])}
        yield proc, lines, stages
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_recommend_command_prints_items_and_timings(served, capsys):
    _, _, stages = served
    rc = main(["recommend", "--user-id", "3", "--num-candidates", "100", "--num-results", "7",
               "--target", stages["gateway"]["address"]])
    out = capsys.readouterr().out
    assert rc == 0, out
    for stage in ("augment_user", "retrieve", "augment_items", "rank", "total", "client"):
        assert f"\n{stage} " in out
    assert "user 3: 7 items" in out


def test_recommend_command_errors(served, capsys):
    _, _, stages = served
    assert main(["recommend", "--user-id", "999999999", "--target", stages["gateway"]["address"]]) == 1
    assert "UnknownUser" in capsys.readouterr().err
    assert main(["recommend", "--user-id", "1", "--num-candidates", "-4", "--target", stages["gateway"]["address"]]) == 1
    assert "num_candidates" in capsys.readouterr().err
    assert main(["recommend", "--user-id", "1", "--timeout", "0"]) == 2


def test_bench_chain_grpc_agrees_with_in_process(served, small_models, small_dataset, tmp_path, capsys):
    _, _, stages = served
    out = tmp_path / "chain.json"
    rc = main(["bench", "chain", "--models", str(small_models), "--data", str(small_dataset), "--queries", "20",
               "--warmup", "3", "--num-candidates", "200", "--threads", "1", "--out", str(out),
               "--target", stages["gateway"]["address"]])
    assert rc == 0
    text = capsys.readouterr().out
    assert "gRPC - in-process" in text
    report = json.loads(out.read_text())
    assert report["disagreements"] == 0  # the same cores give the same answers through gRPC
    assert [row["stage"] for row in report["stages"]] == ["augment_user", "retrieve", "augment_items", "rank"]
    for row in report["stages"]:
        assert 0 < row["grpc_server_p50_us"] <= row["grpc_observed_p50_us"]
        assert row["inprocess_p50_us"] > 0
    assert report["end_to_end"]["grpc_p50_us"] > 0 and report["end_to_end"]["ratio_p50"] > 0


def test_killed_stage_is_restarted(served):
    _, lines, stages = served
    old = stages["features"]["pid"]
    os.kill(old, signal.SIGKILL)
    lines.until(lambda s: f"stage features (pid {old}) exited" in s, timeout=10)
    restarted = lines.until(lambda s: "stage features restarted" in s, timeout=10)
    stages["features"]["pid"] = int(re.search(r"\(pid (\d+)", restarted).group(1))
    assert stages["features"]["pid"] != old
    lines.until(lambda s: "stage features is SERVING again" in s, timeout=120)
    with RecommendClient(stages["gateway"]["address"]) as client:
        deadline = time.monotonic() + 30
        while True:  # the gateway's channel reconnects on its own
            try:
                rec = client.recommend(1, 50, 5)
                break
            except StageUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    assert len(rec.item_ids) == 5


def test_sigterm_drains_and_stops_every_stage(served):
    proc, lines, stages = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    lines.until(lambda s: "all stages stopped" in s, timeout=5)
    time.sleep(0.2)
    for name, stage in stages.items():
        assert not alive(stage["pid"]), name


def test_serve_rejects_missing_directories(tmp_path, capsys):
    assert main(["serve", "--models", str(tmp_path / "nope"), "--data", str(tmp_path)]) == 2
    assert "--models" in capsys.readouterr().err


# recpipe demo over a workdir holding data and models: tests/integration/test_readme_commands.py runs it
# (with its table, run document, charts and next steps checked) as one of the README's commands.


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--scale", "0"]) == 2
    assert main(["demo", "--queries", "0"]) == 2

