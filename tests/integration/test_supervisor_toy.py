"""The supervisor's mechanics on real OS processes that serve a toy feature stage (no model repository):
start and wait for SERVING, restart a killed stage on its port, restart a frozen (SIGSTOPped) one but
leave a busy one (a core call longer than ``unresponsive_s``) alone, fail fast on a stage that cannot
start, stop everything with SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from test_cli_serve import alive

from recpipe.errors import RecpipeError
from recpipe.serving.supervisor import StageProcess, Supervisor, free_port, health_status
from recpipe.v1 import features_pb2, features_pb2_grpc

TOY = Path(__file__).with_name("toy_serve.py")


def toy(name: str, *extra: str) -> StageProcess:
    port = free_port()
    return StageProcess(name, f"127.0.0.1:{port}", (sys.executable, str(TOY), str(port), *extra))


def test_supervisor_starts_restarts_and_stops(caplog):
    sup = Supervisor([toy("a"), toy("b")], startup_timeout_s=60, grace_s=2)
    sup.start()
    try:
        pids = {n: sup.pid(n) for n in ("a", "b")}
        for address in sup.addresses().values():
            with grpc.insecure_channel(address) as channel:
                assert health_status(channel) == "SERVING"
                reply = features_pb2_grpc.FeatureServiceStub(channel).AugmentUser(
                    features_pb2.AugmentUserRequest(user_id=2), timeout=5
                )
                assert reply.user_id == 2

        os.kill(pids["a"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while sup.pid("a") == pids["a"] and time.monotonic() < deadline:
            sup.check()
            time.sleep(0.05)
        assert sup.pid("a") != pids["a"]
        assert sup.pid("b") == pids["b"]
        sup.wait_serving(["a"], timeout_s=30)
        with grpc.insecure_channel(sup.addresses()["a"]) as channel:
            assert health_status(channel) == "SERVING"
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert f"stage a (pid {pids['a']}) exited with code -9" in messages
        assert "stage a restarted" in messages
    finally:
        sup.stop()
    for name in ("a", "b"):
        pid = sup.pid(name)
        assert pid is not None and not alive(pid)
        assert sup.children[name].proc.returncode == 0  # type: ignore[union-attr]  # drained, clean exit


def test_supervisor_fails_fast_when_a_stage_cannot_start():
    good, bad = toy("good"), toy("bad", "--fail-at-start")
    sup = Supervisor([good, bad], startup_timeout_s=60, grace_s=1)
    with pytest.raises(RecpipeError, match="stage bad exited with code 3 during start-up"):
        sup.start()
    pid = sup.pid("good")
    assert pid is not None and not alive(pid)


def test_supervisor_restarts_a_frozen_stage(caplog):
    caplog.set_level(logging.WARNING, logger="recpipe.serving.supervisor")
    sup = Supervisor([toy("frozen"), toy("fine")], startup_timeout_s=60, grace_s=1, unresponsive_s=1.5)
    sup.start()
    stop = threading.Event()
    watcher = threading.Thread(target=sup.run, args=(stop, 0.2), daemon=True)
    old = sup.pid("frozen")
    assert old is not None
    try:
        watcher.start()
        os.kill(old, signal.SIGSTOP)  # alive, but its health never answers again
        deadline = time.monotonic() + 20
        while sup.pid("frozen") == old and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sup.pid("frozen") != old, "the frozen stage was not restarted"
        assert not alive(old) or _zombie(old)
        deadline = time.monotonic() + 30
        while not sup.children["frozen"].serving and time.monotonic() < deadline:
            time.sleep(0.1)
        with grpc.insecure_channel(sup.addresses()["frozen"]) as channel:
            assert health_status(channel) == "SERVING"
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert f"stage frozen (pid {old}) has not answered its health check for" in messages
        assert "frozen or hung" in messages
        assert "stage frozen restarted" in messages
        assert "stage fine" not in messages  # the healthy one was left alone
    finally:
        stop.set()
        watcher.join(30)
        with contextlib.suppress(ProcessLookupError):
            os.kill(old, signal.SIGKILL)


def test_supervisor_leaves_a_stage_busy_with_a_long_core_call_alone(caplog):
    """Core calls longer than ``unresponsive_s`` (with the default ``--workers 0``) run off the event loop,
    so the stage's health keeps answering and the supervisor tells busy from frozen."""
    caplog.set_level(logging.WARNING, logger="recpipe.serving.supervisor")
    sup = Supervisor([toy("busy", "--delay", "2.5")], startup_timeout_s=60, grace_s=1, unresponsive_s=1.0)
    sup.start()
    stop = threading.Event()
    watcher = threading.Thread(target=sup.run, args=(stop, 0.2), daemon=True)
    pid = sup.pid("busy")
    try:
        watcher.start()
        with grpc.insecure_channel(sup.addresses()["busy"]) as channel:
            stub = features_pb2_grpc.FeatureServiceStub(channel)
            for user in (2, 3):  # the first has no estimate yet, the second is predicted long: both off the loop
                reply = stub.AugmentUser(features_pb2.AugmentUserRequest(user_id=user), timeout=30)
                assert reply.user_id == user
        assert sup.pid("busy") == pid and sup.children["busy"].restarts == 0
        assert "has not answered its health check" not in caplog.text
    finally:
        stop.set()
        watcher.join(30)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return False


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_serve_rejects_a_bad_unresponsive_timeout(value, capsys):
    from recpipe.cli import main

    assert main(["serve", "--unresponsive-timeout", value]) == 2
    err = capsys.readouterr().err
    assert "--unresponsive-timeout" in err and len(err.strip().splitlines()) == 1
