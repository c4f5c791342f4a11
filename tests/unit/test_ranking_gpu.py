"""The GPU flags of serve/bench as one-line errors, and the CUDA cores against the CPU ones (``gpu``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from cli_support import one_line_exit_2
from fast_path_support import CUDA, no_cuda_only

from recpipe.features.core import FeatureCore
from recpipe.ranking.core import RankingCore
from recpipe.retrieval.core import RetrievalCore


@pytest.mark.parametrize(("argv", "needle"), [
    (["serve", "--rescore", "-1"], "--rescore"),
    (["serve", "--retrieval-precision", "fp8"], "--retrieval-precision"),
    (["serve", "--embeddings", "disk"], "--embeddings"),
    (["serve", "--embeddings", "host", "--device", "cpu"], "--embeddings host needs a CUDA device"),
    (["bench", "retrieval", "--rescore", "99"], "--rescore"),
])
def test_bad_gpu_flags_are_one_line_errors(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    one_line_exit_2(capsys, argv, needle)


@no_cuda_only
@pytest.mark.parametrize("argv", [
    ["serve", "--nvtx"], ["serve", "--stage", "ranking", "--nvtx"], ["serve", "--embeddings", "host"],
    ["bench", "ranking", "--nvtx"], ["bench", "chain", "--nvtx"],
])
def test_cuda_only_flags_without_cuda_are_one_line_errors(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    one_line_exit_2(capsys, argv, "needs")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_cores_match_the_cpu(features: FeatureCore, small_models: Path) -> None:
    cpu_rank = RankingCore.load(small_models, device="cpu")
    user, items = features.augment_user(4), features.augment_items(4, np.arange(50))
    for kwargs in ({}, {"cuda_graphs": False}, {"embeddings": "host"}):
        gpu = RankingCore.load(small_models, device="cuda", **kwargs)
        for _ in range(2):
            np.testing.assert_allclose(gpu.rank(user, items), cpu_rank.rank(user, items), rtol=1e-4, atol=1e-5)
    assert gpu.details["embeddings"].startswith("host")
    weight = gpu.predictor.model.sparse_arch.tables.weight
    assert weight.device.type == "cuda"
    cpu_ret = RetrievalCore.load(small_models, device="cpu", precision="fp32")
    gpu_ret = RetrievalCore.load(small_models, device="cuda")
    assert gpu_ret.details["precision"] == "fp16" and gpu_ret.details["cuda_graphs"] == "graph"
    assert float(gpu_ret.details["fp16_recall_at_500_vs_fp32"]) >= 0.99
    torch.testing.assert_close(gpu_ret.query_embeddings(user.dense[None], user.sparse[None]).cpu(),
                               cpu_ret.query_embeddings(user.dense[None], user.sparse[None]), rtol=1e-4, atol=1e-5)
    got, want = gpu_ret.retrieve(user, 100), cpu_ret.retrieve(user, 100)
    assert len(set(got.item_ids) & set(want.item_ids)) >= 95  # cpu: the tuned index, gpu: exact
    searches = gpu_ret._searches.values()
    assert sum(r.captured for r in searches) >= 2 and not any(r.failed for r in searches), \
        "tower + fp16 search (topk, gather, bmm) did not capture as one CUDA graph; see the warning log"
    assert gpu.predictor._runner is not None and gpu.predictor._runner.failed == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_query_vectors_are_whole_when_the_caller_reads_them_on_its_own_stream(features: FeatureCore,
                                                                              small_models: Path) -> None:
    """query_embeddings computes on the stage's stream; a caller's ``.cpu()`` on the default stream
    must see the finished vectors of that very user (it saw a stale or half-written one before
    ``DeviceIO.hand_over``: the retrieval bench's truth, and the FAISS path's queries, were off)."""
    gpu = RetrievalCore.load(small_models, device="cuda", precision="fp32")
    cpu = RetrievalCore.load(small_models, device="cpu", precision="fp32")
    users = [features.augment_user(u) for u in range(64)]
    got = [gpu.query_embeddings(u.dense[None], u.sparse[None]).cpu() for u in users]  # no synchronize between
    for u, g in zip(users, got, strict=True):
        torch.testing.assert_close(g, cpu.query_embeddings(u.dense[None], u.sparse[None]), rtol=1e-4, atol=1e-5)


def test_hand_over_is_a_no_op_off_cuda() -> None:
    from recpipe.accel.transfer import DeviceIO

    io = DeviceIO(torch.device("cpu"))
    t = torch.ones(3)
    assert io.hand_over(t) is t
