"""The supervisor's mechanics on real OS processes that serve a toy feature stage (no model repository):
start and wait for SERVING, restart a killed stage on its port, fail fast on a stage that cannot start,
stop everything with SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest

from recpipe.errors import RecpipeError
from recpipe.serving.supervisor import StageProcess, Supervisor, free_port, health_status
from recpipe.v1 import features_pb2, features_pb2_grpc

TOY = Path(__file__).with_name("toy_serve.py")


def toy(name: str, *extra: str) -> StageProcess:
    port = free_port()
    return StageProcess(name, f"127.0.0.1:{port}", (sys.executable, str(TOY), str(port), *extra))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
