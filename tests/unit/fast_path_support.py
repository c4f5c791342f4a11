"""Shared by the GPU fast-path tests (test_cuda_graphs, test_transfer, test_ranking_gpu,
test_retrieval_gpu, test_nvtx): a tiny DLRM, its inputs, and the CUDA skip markers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recpipe.ranking.model import DLRM, DLRMConfig

CUDA = torch.cuda.is_available()
no_cuda_only = pytest.mark.skipif(CUDA, reason="checks the error given on a machine without CUDA")

SIZES = (7, 3, 11, 5, 2, 9)  # 4 "user" + 2 "item" tables


def small_model(seed: int = 0) -> DLRM:
    torch.manual_seed(seed)
    return DLRM(DLRMConfig(user_dense_dim=5, item_dense_dim=4, table_sizes=SIZES, embedding_dim=8,
                           bottom_dims=(16,), top_dims=(32, 8))).eval()


def batch_inputs(counts: list[int], seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    b, n = len(counts), sum(counts)
    ud = rng.normal(size=(b, 5)).astype(np.float32)
    us = np.stack([rng.integers(0, s, b) for s in SIZES[:4]], 1)
    idn = rng.normal(size=(n, 4)).astype(np.float32)
    isp = np.stack([rng.integers(0, s, n) for s in SIZES[4:]], 1)
    return ud, us, idn, isp
