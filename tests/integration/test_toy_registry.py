"""A stage that lives outside ``recpipe`` is served by the real ``recpipe serve --stage all`` machinery
(supervisor, launch, ports, options, upstream targets) from its spec alone (``toy_registry.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from test_cli_serve import Lines, free_port_block

from recpipe.client import RecommendClient
from recpipe.v1 import features_pb2, features_pb2_grpc

HERE = Path(__file__).parent


def toy_env() -> dict[str, str]:
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "RECPIPE_REGISTRY": "toy_registry:REGISTRY", "PYTHONPATH": path}


@contextlib.contextmanager
def serving_toys(tmp_path: Path, base: int, *extra: str) -> Iterator[tuple[subprocess.Popen[str], Lines]]:
    """``recpipe [--log-level INFO] serve`` over the toy registry at ``base``, SERVING; on leaving, SIGTERM
    must stop it cleanly (exit 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "recpipe", "--log-level", "INFO", "serve", "--models", str(tmp_path), "--data",
         str(tmp_path), "--port", str(base), "--metrics-port", "-1", "--grace", "1", *extra],
        env=toy_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = Lines(proc.stdout)
        lines.until(lambda line: line.startswith("recpipe serving (2 stages"), timeout=120)
        yield proc, lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_help_lists_the_toy_stages_and_their_option() -> None:
    out = subprocess.run([sys.executable, "-m", "recpipe", "serve", "--help"], env=toy_env(), capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "{all,toy,front}" in out and "--toy-users" in out and "--toy TARGET" in out
    assert "--rescore" not in out  # recpipe's own stages are not in this registry


def test_a_bad_toy_option_is_a_one_line_error() -> None:
    run = subprocess.run([sys.executable, "-m", "recpipe", "serve", "--toy-users", "0"], env=toy_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip() == "recpipe: error: --toy-users must be >= 1, got 0"


@pytest.mark.slow
def test_serve_runs_a_registry_of_toy_stages(tmp_path: Path) -> None:
    base = free_port_block(2)
    with serving_toys(tmp_path, base, "--toy-users", "7"):
        with RecommendClient(f"127.0.0.1:{base}", timeout=10) as client:
            front = client.info()
        assert front.stage == "front" and front.details["toy"] == f"127.0.0.1:{base + 1}"
        with RecommendClient(f"127.0.0.1:{base + 1}", timeout=10) as client:
            toy = client.info()
        assert toy.stage == "toy" and toy.details["num_users"] == "7"  # --toy-users reached the toy process
        with grpc.insecure_channel(f"127.0.0.1:{base + 1}") as channel:
            stub = features_pb2_grpc.FeatureServiceStub(channel)
            assert stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=6), timeout=10).user_id == 6
            with pytest.raises(grpc.RpcError) as bad:
                stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=7), timeout=10)
            assert bad.value.code() == grpc.StatusCode.NOT_FOUND


def _stage_pids(supervisor_pid: int, stage: str) -> set[int]:
    """The supervisor's children running ``--stage STAGE`` (the serving process and its standby)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == supervisor_pid and b"--stage" in argv and argv[argv.index(b"--stage") + 1] == stage.encode():
            found.add(int(entry.name))
    return found


@pytest.mark.slow
def test_a_killed_stage_is_replaced_by_its_warm_standby(tmp_path: Path) -> None:
    """``recpipe serve`` keeps a loaded standby per stage; when the serving process dies, the standby
    (already running before the kill) takes the port, and a new standby is started behind it."""
    import time

    base = free_port_block(2)
    with serving_toys(tmp_path, base) as (proc, lines):
        if not any("toy: warm standby loaded" in line for line in lines.seen):  # it may come before or after
            lines.until(lambda line: "toy: warm standby loaded" in line, timeout=60)
        address = f"127.0.0.1:{base + 1}"
        deadline = time.monotonic() + 60
        while len(pids := _stage_pids(proc.pid, "toy")) < 2:  # the serving process and its standby
            assert time.monotonic() < deadline, pids
            time.sleep(0.1)
        listening = next(p for p in pids if f"{base + 1:04X}" in _listen_ports(p))
        standby = (pids - {listening}).pop()
        os.kill(listening, signal.SIGKILL)
        lines.until(lambda line: "stage toy restarted from its warm standby" in line, timeout=60)
        deadline = time.monotonic() + 30
        while True:
            try:
                with RecommendClient(address, timeout=5) as client:
                    assert client.info().stage == "toy"
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert f"{base + 1:04X}" in _listen_ports(standby)  # the old standby now serves the port


def _listen_ports(pid: int) -> str:
    """The hex ports of the listening TCP sockets in ``pid``'s network namespace, for the sockets it owns."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                out.append(cols[1].rsplit(":", 1)[1])
    return " ".join(out)
