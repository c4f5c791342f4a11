"""Stages as real processes on loopback: each reaches SERVING, answers, and after a kill -9 comes back
on the same port and answers the same (``recpipe.bench.coldstart`` starts and times them)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from recpipe.bench import coldstart
from recpipe.serving import codec
from recpipe.serving.channels import make_blocking_channel
from recpipe.serving.inline import COMPUTE_CPU_KEY
from recpipe.serving.supervisor import free_port
from recpipe.v1 import (
    features_pb2,
    features_pb2_grpc,
    info_pb2,
    info_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)


def _answers(ports: dict[str, int]) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """AugmentUser on the features stage, Retrieve with its answer, and retrieval's GetInfo details."""
    with make_blocking_channel(f"127.0.0.1:{ports['features']}") as fch, \
            make_blocking_channel(f"127.0.0.1:{ports['retrieval']}") as rch:
        user = features_pb2_grpc.FeatureServiceStub(fch).AugmentUser(features_pb2.AugmentUserRequest(user_id=3),
                                                                     timeout=10)
        found = retrieval_pb2_grpc.RetrievalServiceStub(rch).Retrieve(
            retrieval_pb2.RetrieveRequest(user_dense=user.dense, user_sparse=user.sparse, k=50), timeout=10)
        info = info_pb2_grpc.InfoServiceStub(rch).GetInfo(info_pb2.GetInfoRequest(), timeout=10)
    dense = codec.decode(user.dense, "dense", "float32", None)
    return dense, codec.decode(found.item_ids, "item_ids", "int64", (50,)), dict(info.details)


@pytest.mark.slow
def test_stages_serve_and_answer_again_after_kill_9(small_models: Path, small_dataset: Path) -> None:
    ports = {"features": free_port(), "retrieval": free_port()}
    procs = {}
    try:
        for stage, port in ports.items():
            t0 = time.perf_counter()
            procs[stage] = coldstart.start(stage, small_models, small_dataset, port)
            assert coldstart.wait_serving(procs[stage], f"127.0.0.1:{port}", t0, timeout=120) > 0
        dense, ids, details = _answers(ports)
        assert len(set(ids.tolist())) == 50 and details["user_tower"] == "folded-numpy"
        for stage, port in ports.items():
            procs[stage].send_signal(signal.SIGKILL)
            procs[stage].wait(timeout=10)
            coldstart.stop(procs[stage])
            with make_blocking_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError):
                info_pb2_grpc.InfoServiceStub(ch).GetInfo(info_pb2.GetInfoRequest(), timeout=1)
            t0 = time.perf_counter()
            procs[stage] = coldstart.start(stage, small_models, small_dataset, port)
            coldstart.wait_serving(procs[stage], f"127.0.0.1:{port}", t0, timeout=120)
        again_dense, again_ids, again_details = _answers(ports)
        np.testing.assert_array_equal(again_dense, dense)
        np.testing.assert_array_equal(again_ids, ids)
        # the same stage again, but for its running count of compute CPU
        assert {k: v for k, v in again_details.items() if k != COMPUTE_CPU_KEY} == \
            {k: v for k, v in details.items() if k != COMPUTE_CPU_KEY}
        assert float(details[COMPUTE_CPU_KEY]) > 0
    finally:
        for proc in procs.values():
            coldstart.stop(proc)


def test_cold_start_refuses_a_tree_that_is_not_recpipe(tmp_path: Path, small_models: Path, small_dataset: Path) -> None:
    from recpipe.cli import main

    rc = main(["bench", "coldstart", "--models", str(small_models), "--data", str(small_dataset),
               "--source", str(tmp_path), "--repeats", "1"])
    assert rc == 2
    assert main(["bench", "coldstart", "--models", str(small_models), "--data", str(small_dataset),
                 "--stage", "cache"]) == 2
