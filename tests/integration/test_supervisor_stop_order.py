"""The supervisor stops a chain callers first (real OS processes serving a toy feature stage): a stage is
sent SIGTERM only once the processes that call it have drained and exited, so the calls they finish
on their way out still find it. Signalled together, the gateway's queries in flight at a ``recpipe
serve`` stop failed with UNAVAILABLE from a stage that had stopped under them (7 of 8 in a run
with two replicas of each of features, ranking and gateway)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import grpc

from recpipe.serving.supervisor import StageProcess, Supervisor, free_port
from recpipe.v1 import features_pb2, features_pb2_grpc

TOY = Path(__file__).with_name("toy_serve.py")


def test_stop_signals_a_stage_only_after_its_callers_have_drained() -> None:
    called_port, front_port = free_port(), free_port()
    called = StageProcess("toy", f"127.0.0.1:{called_port}", (sys.executable, str(TOY), str(called_port)))
    # the caller's AugmentUser takes 1.5 s: a call in flight that it drains within its 2 s grace
    front = StageProcess("front", f"127.0.0.1:{front_port}",
                         (sys.executable, str(TOY), str(front_port), "--delay", "1.5"), calls=("toy",))
    sup = Supervisor([called, front], startup_timeout_s=60, grace_s=2)
    sup.start()
    outcome: list[str] = []

    def call() -> None:
        with grpc.insecure_channel(front.address) as channel:
            try:
                features_pb2_grpc.FeatureServiceStub(channel).AugmentUser(
                    features_pb2.AugmentUserRequest(user_id=3), timeout=10)
                outcome.append("OK")
            except grpc.RpcError as e:
                outcome.append(e.code().name)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        time.sleep(0.5)  # the call is in the front's core
    finally:
        stopper = threading.Thread(target=sup.stop)
        stopper.start()
    exited: dict[str, float] = {}
    procs = {name: sup.children[name].proc for name in ("toy", "front")}
    deadline = time.monotonic() + 20
    while len(exited) < 2 and time.monotonic() < deadline:
        for name, proc in procs.items():
            if name not in exited and proc is not None and proc.poll() is not None:
                exited[name] = time.monotonic()
        time.sleep(0.01)
    stopper.join(20)
    caller.join(10)
    assert outcome == ["OK"]
    assert set(exited) == {"toy", "front"}, exited
    # the called stage was still there while its caller drained: it exits after it, not ~1 s before
    assert exited["toy"] >= exited["front"], exited
    assert [p.returncode for p in procs.values() if p is not None] == [0, 0]
