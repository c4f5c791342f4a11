"""A stage that lives outside ``recpipe`` is served by the real ``recpipe serve --stage all`` machinery
(supervisor, launch, ports, options, upstream targets) from its spec alone (``toy_registry.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "recpipe", "serve", "--models", str(tmp_path), "--data", str(tmp_path),
         "--port", str(base), "--metrics-port", "-1", "--toy-users", "7", "--grace", "1"],
        env=toy_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = Lines(proc.stdout)
        lines.until(lambda line: line.startswith("recpipe serving (2 stages"), timeout=120)
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
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
