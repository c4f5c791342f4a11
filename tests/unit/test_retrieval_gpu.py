"""Half-precision exact retrieval with the fp32 re-score, and its padded (graph) twin, on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recpipe.errors import UsageError
from recpipe.features.core import FeatureCore
from recpipe.retrieval import index as faiss_index
from recpipe.retrieval.contract import RetrieveQuery
from recpipe.retrieval.core import RetrievalCore


def clustered(n: int, d: int = 32, clusters: int = 40, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, d))
    x = centers[rng.integers(0, clusters, n)] + 0.35 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_search_with_rescore_reaches_the_recall_target(precision: str) -> None:
    items, queries = clustered(8000), clustered(40, seed=1)
    cpu = torch.device("cpu")
    search = faiss_index.TorchExactSearch(items, cpu, precision, rescore=2)
    assert search.items.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    assert search.full is not None and search.full.dtype == torch.float32
    scores, ids = search.search(torch.from_numpy(queries), 500)
    truth = faiss_index.exact_topk(queries, items, 500)
    assert faiss_index.recall(ids, truth) >= 0.99
    # re-scored answers carry exact fp32 inner products, in descending order
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ items.T, ids, 1), rtol=1e-5, atol=1e-6)
    assert (np.diff(scores, axis=1) <= 0).all()
    with_rescore = faiss_index.half_recall(items, cpu, precision, 2, 500, queries)
    alone = faiss_index.half_recall(items, cpu, precision, 0, 500, queries)
    assert with_rescore >= 0.99 and with_rescore >= alone
    assert faiss_index.half_recall(items, cpu, "fp32", 0, 500, queries) == 1.0


def test_half_precision_search_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="unknown precision"):
        faiss_index.TorchExactSearch(clustered(10), torch.device("cpu"), "fp8")
    with pytest.raises(ValueError, match="rescore must be >= 0"):
        faiss_index.TorchExactSearch(clustered(10), torch.device("cpu"), "fp16", -1)


def test_retrieval_core_in_fp16_reports_recall_and_agrees(features: FeatureCore, small_models: Path) -> None:
    fp32 = RetrievalCore.load(small_models, device="cpu", precision="fp32")
    half = RetrievalCore.load(small_models, device="cpu", precision="fp16")
    assert fp32.details["precision"] == "fp32" and fp32.half_recall is None
    d = half.details
    assert d["backend"] == "torch-exact-fp16+fp32-rescore-x2" and d["precision"] == "fp16"
    assert float(d["fp16_recall_at_500_vs_fp32"]) >= 0.99 and half.half_recall is not None
    emb = fp32.item_embeddings()
    for uid in range(3):
        user = features.augment_user(uid)
        got = half.retrieve(user, 100)
        q = fp32.query_embeddings(user.dense[None], user.sparse[None]).numpy()
        truth = faiss_index.exact_topk(q, emb, 100)
        assert faiss_index.recall(got.item_ids[None], truth) >= 0.99
        assert (np.diff(got.scores) <= 1e-7).all()
    with pytest.raises(UsageError, match="--retrieval-precision"):
        RetrievalCore.load(small_models, device="cpu", precision="fp8")
    with pytest.raises(UsageError, match="--rescore"):
        RetrievalCore.load(small_models, device="cpu", precision="fp16", rescore=-1)


def test_exact_search_graph_twin_answers_each_query_as_if_alone(features: FeatureCore, small_models: Path) -> None:
    """Tower + fp16 search padded to (bucket(B), bucket(k, 16)) and sliced: a query's answer is the same in
    any batch, and its ids agree with the unpadded search (which keeps fewer candidates to re-score)."""
    padded = RetrievalCore.load(small_models, device="cpu", precision="fp16", graphs="padded")
    eager = RetrievalCore.load(small_models, device="cpu", precision="fp16")
    users = [features.augment_user(u) for u in range(6)]
    queries = [RetrieveQuery.checked(u.dense, u.sparse, k, padded.limits) for u, k in zip(users, (100, 100, 37, 100, 5, 37), strict=True)]
    batched = padded.retrieve_batch(queries)
    for q, got in zip(queries, batched, strict=True):
        alone = padded.retrieve_batch([q])[0]
        assert got.item_ids.shape == (q.k,)
        np.testing.assert_array_equal(got.item_ids, alone.item_ids)
        np.testing.assert_allclose(got.scores, alone.scores, rtol=1e-6)
        ref = eager.retrieve_batch([q])[0]
        assert len(set(ref.item_ids) & set(got.item_ids)) >= 0.99 * q.k
    # every k bucket was built at load (warm), so none is built on the request path
    k_max = padded.limits.max_k
    assert set(padded._searches) == {min(16 << i, k_max) for i in range(k_max.bit_length()) if 16 << i < 2 * k_max}
    assert {16, 64, 128} <= set(padded._searches) and not eager._tower.padded
