"""``recpipe serve`` as users run it: ``--stage all`` as a real process tree over the shared tiny model
repository; ``recpipe recommend`` against it; a killed stage is restarted; SIGTERM stops everything."""

from __future__ import annotations

import contextlib
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


def free_port_block(count: int = 4) -> int:
    """A base port B such that B .. B+count-1 were all free a moment ago."""
    import random
    import socket

    for _ in range(200):
        base = random.randint(20000, 60000)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no block of free ports")


class GatewayWatch:
    """Polls the gateway's health from before the gateway exists, recording every change; right after
    the first SERVING it sends one Recommend (no retry), as a client trusting a readiness probe would."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.changes: list[tuple[float, str]] = []  # (time.monotonic(), status)
        self.first_recommend: object = None
        self.first_done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import grpc

        from recpipe.serving.supervisor import health_status

        fast = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
                ("grpc.max_reconnect_backoff_ms", 50)]
        with grpc.insecure_channel(self.address, options=fast) as channel:
            while not self._stop.is_set():
                status = health_status(channel, timeout=1.0)
                if not self.changes or self.changes[-1][1] != status:
                    self.changes.append((time.monotonic(), status))
                if status == "SERVING" and not self.first_done.is_set():
                    try:
                        with RecommendClient(self.address) as client:
                            self.first_recommend = client.recommend(1, 50, 5, timeout=10)
                    except Exception as e:
                        self.first_recommend = e
                    self.first_done.set()
                self._stop.wait(0.02)

    def seen_after(self, since: float, status: str, timeout: float) -> float:
        """The time ``status`` was first recorded after ``since``; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, s in list(self.changes):
                if at >= since and s == status:
                    return at
            time.sleep(0.05)
        raise AssertionError(f"gateway health never {status} after t={since:.2f}: {self.changes}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture(scope="module")
def gateway_watch():
    """A ``GatewayWatch`` on the port ``served`` will put its gateway on, started before it."""
    base = free_port_block()
    watch = GatewayWatch(f"127.0.0.1:{base}")
    yield watch
    watch.stop()


@pytest.fixture(scope="module")
def served(small_models, small_dataset, gateway_watch):
    base = int(gateway_watch.address.rsplit(":", 1)[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "recpipe", "--log-level", "WARNING", "serve", "--models", str(small_models),
         "--data", str(small_dataset), "--port", str(base), "--metrics-port", "0", "--threads", "1",
         "--grace", "2", "--ranking-precision", "fp32"],  # fp32: bench chain compares it with in-process cores
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


def test_first_gateway_serving_is_followed_by_a_successful_recommend(served, gateway_watch):
    watch = gateway_watch
    assert watch.first_done.wait(30), watch.changes
    assert not isinstance(watch.first_recommend, Exception), (watch.first_recommend, watch.changes)
    assert len(watch.first_recommend.item_ids) == 5
    assert [s for _, s in watch.changes][-1] == "SERVING"
    assert "SERVING" not in [s for _, s in watch.changes][:-1]  # never SERVING before it could answer


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
    assert main(["recommend", "--user-id", "999999999", "--target", stages["gateway"]["address"]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recpipe: error: UnknownUser: ") and err.count("\n") == 1
    assert main(["recommend", "--user-id", "1", "--num-candidates", "-4", "--target", stages["gateway"]["address"]]) == 2
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


def expected_cpus(stage: str) -> set[int]:
    """The CPUs ``served``'s ``stage`` process must run on: ``--affinity auto`` for its settings (one thread
    per stage) on this machine's usable CPUs (all of them for a stage it does not place)."""
    from recpipe.serving.affinity import plan
    from recpipe.serving.threads import usable_cpus
    from recpipe.stages import registry

    placement, _ = plan(registry(), "auto", {}, 1)
    return set(placement[stage][0]) if stage in placement else set(usable_cpus())


def test_each_stage_process_runs_on_the_cpus_its_affinity_line_names(served):
    from recpipe.serving.affinity import plan
    from recpipe.stages import registry

    _, lines, stages = served
    line = next((s for s in lines.seen if s.startswith("affinity: ")), None) or \
        lines.until(lambda s: s.startswith("affinity: "), timeout=5)
    placement, said = plan(registry(), "auto", {}, 1)
    assert line.strip() == said
    for name, stage in stages.items():
        assert os.sched_getaffinity(stage["pid"]) == expected_cpus(name), (name, line)
        masks = set()
        for tid in os.listdir(f"/proc/{stage['pid']}/task"):  # every thread, started before or after the pin
            with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile
                masks.add(frozenset(os.sched_getaffinity(int(tid))))
        assert masks == {frozenset(expected_cpus(name))}, name
    if len(os.sched_getaffinity(0)) == 2:  # this machine's case (CI: 2 cores, 4 processes)
        assert placement["ranking"] != placement["features"] and "gateway" not in placement, line


def test_killed_stage_is_restarted(served, gateway_watch):
    _, lines, stages = served
    old = stages["features"]["pid"]
    killed_at = time.monotonic()
    os.kill(old, signal.SIGKILL)
    lines.until(lambda s: f"stage features (pid {old}) exited" in s, timeout=10)
    restarted = lines.until(lambda s: "stage features restarted" in s, timeout=10)
    stages["features"]["pid"] = int(re.search(r"\(pid (\d+)", restarted).group(1))
    assert stages["features"]["pid"] != old
    lines.until(lambda s: "stage features is SERVING again" in s, timeout=120)
    assert os.sched_getaffinity(stages["features"]["pid"]) == expected_cpus("features")  # the new one is placed too
    # the gateway's health followed: NOT_SERVING while features was down, SERVING again after
    down = gateway_watch.seen_after(killed_at, "NOT_SERVING", timeout=10)
    gateway_watch.seen_after(down, "SERVING", timeout=30)
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


def test_serve_refuses_a_bad_repository_in_one_line_before_any_stage_starts(small_models, small_dataset, tmp_path,
                                                                            capsys):
    """A truncated or missing artifact, or data the models were not trained on, is one line and exit 2 from
    ``recpipe serve`` itself. Before, the stages started, the ones that read it died (their errors, then the
    supervisor's "stage ranking exited with code 2"), and serve exited 1 after printing 2-4 lines."""
    import shutil

    models = tmp_path / "models"
    shutil.copytree(small_models, models)
    (models / "ranking" / "dlrm.safetensors").write_bytes(b"\0" * 100)
    port = str(free_port_block())
    assert main(["serve", "--models", str(models), "--data", str(small_dataset), "--port", port]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "dlrm.safetensors" in err[0] and "truncated" in err[0], err
    assert "recpipe-stage-ready" not in captured.out + captured.err
    shutil.rmtree(models)
    shutil.copytree(small_models, models)
    (models / "retrieval" / "index.faiss").unlink()
    assert main(["serve", "--models", str(models), "--data", str(small_dataset), "--port", port]) == 2
    assert "index.faiss: artifact is missing" in capsys.readouterr().err
    other = tmp_path / "other-data"
    shutil.copytree(small_dataset, other)
    manifest = json.loads((other / "manifest.json").read_text())
    name = sorted(manifest["sha256"])[0]
    manifest["sha256"][name] = "0" * 64  # another dataset as far as the repository can tell
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert main(["serve", "--models", str(small_models), "--data", str(other), "--port", port]) == 2
    assert "dataset does not match" in capsys.readouterr().err


# recpipe demo over a workdir holding data and models: tests/integration/test_readme_commands.py runs it
# (with its table, run document, charts and next steps checked) as one of the README's commands.


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--scale", "0"]) == 2
    assert main(["demo", "--queries", "0"]) == 2

