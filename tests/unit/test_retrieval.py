"""FAISS indexes against exact search, the tuner, the two-tower loss, and RetrievalCore."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recpipe.errors import BadRequest
from recpipe.features.core import FeatureCore
from recpipe.retrieval import index as faiss_index
from recpipe.retrieval.contract import MAX_EF_SEARCH, MAX_NPROBE
from recpipe.retrieval.core import RetrievalCore
from recpipe.retrieval.model import TwoTower, TwoTowerConfig
from recpipe.types import UserFeatures


def clustered(n: int, d: int = 32, clusters: int = 40, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, d))
    x = centers[rng.integers(0, clusters, n)] + 0.35 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    items = clustered(6000)
    queries = clustered(300, seed=1)
    return items, queries


def test_exact_topk_matches_brute_force(data) -> None:
    items, queries = data
    ids = faiss_index.exact_topk(queries[:10], items, 20)
    brute = np.argsort(-(queries[:10] @ items.T), axis=1, kind="stable")[:, :20]
    assert faiss_index.recall(ids, brute) > 0.999


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_tuned_index_reaches_recall_target_against_exact(kind: str, data) -> None:
    items, queries = data
    index, nlist = faiss_index.build(items, kind)
    spec = faiss_index.tune(index, kind, nlist, items, queries[:150], target=0.95)
    truth = faiss_index.exact_topk(queries[150:], items, 100)
    faiss_index.set_search_params(index, spec, k=100)
    measured = faiss_index.recall(index.search(queries[150:], 100)[1], truth)
    assert spec.recall_at_100 >= 0.95
    assert measured >= 0.93  # held-out queries: close to the tuned recall
    if kind == "flat":
        assert measured > 0.999
    if kind == "ivf":
        assert 1 <= spec.nprobe <= spec.max_nprobe <= nlist
        assert nlist == faiss_index.default_nlist(len(items))
    if kind == "hnsw":
        assert spec.ef_search <= spec.max_ef_search


def test_auto_picks_an_index_reaching_the_target(data) -> None:
    items, queries = data
    _, spec, tried = faiss_index.build_tuned(items, queries[:150], "auto", 0.95)
    assert {s.kind for s in tried} == {"flat", "ivf", "hnsw"}
    assert spec.recall_at_100 >= 0.95
    assert spec.search_ms_p50 == min(s.search_ms_p50 for s in tried if s.recall_at_100 >= 0.95)


def test_default_nlist_is_in_range() -> None:
    n = 850_000
    assert 4 * np.sqrt(n) <= faiss_index.default_nlist(n) <= 16 * np.sqrt(n)
    assert faiss_index.default_nlist(100) >= 1


def test_in_batch_loss_masks_duplicate_items_and_prefers_the_positive() -> None:
    cfg = TwoTowerConfig(3, 2, (4,), (5,), embedding_dim=4, hidden_dims=(8,), out_dim=4, temperature=0.1)
    model = TwoTower(cfg)
    e = torch.nn.functional.normalize(torch.randn(4, 4), dim=-1)
    ids = torch.tensor([0, 1, 2, 3])
    good = model.in_batch_loss(e, e, ids, torch.zeros(4))
    bad = model.in_batch_loss(e, e.roll(1, 0), ids, torch.zeros(4))
    assert good < bad
    # a duplicate of the positive item elsewhere in the batch is not a negative
    dup = model.in_batch_loss(e, torch.stack([e[0], e[0], e[2], e[3]]), torch.tensor([0, 0, 2, 3]), torch.zeros(4))
    assert torch.isfinite(dup)


@pytest.fixture(scope="module")
def cores(small_models: Path, small_dataset: Path) -> tuple[FeatureCore, RetrievalCore]:
    return FeatureCore.load(small_models, small_dataset), RetrievalCore.load(small_models, device="cpu")


def test_retrieve_returns_k_distinct_valid_ids_sorted(cores) -> None:
    features, retrieval = cores
    assert retrieval.num_items == features.num_items
    assert retrieval.details["backend"] == "faiss-cpu"
    assert retrieval.details["index_type"] in ("flat", "ivf", "hnsw")
    user = features.augment_user(5)
    for k in (1, 10, min(500, features.num_items), features.num_items):
        found = retrieval.retrieve(user, k)
        assert found.item_ids.shape == (k,) and found.item_ids.dtype == np.int64
        assert len(np.unique(found.item_ids)) == k
        assert ((found.item_ids >= 0) & (found.item_ids < features.num_items)).all()
        assert found.scores.dtype == np.float32 and (np.diff(found.scores) <= 1e-6).all()


def test_retrieve_agrees_with_exact_search(cores, small_models: Path) -> None:
    from safetensors.torch import load_file

    features, retrieval = cores
    emb = load_file(str(small_models / "retrieval" / "item_embeddings.safetensors"))["embeddings"].numpy()
    users = [features.augment_user(u) for u in range(0, min(features.num_users, 60))]
    q = np.concatenate([retrieval.query_embeddings(u.dense[None], u.sparse[None]).numpy() for u in users])
    truth = faiss_index.exact_topk(q, emb, 100)
    found = np.stack([retrieval.retrieve(u, 100).item_ids for u in users])
    assert faiss_index.recall(found, truth) >= 0.9
    # the widest search allowed is at least as good as the tuned default
    wide = np.stack([retrieval.retrieve(u, 100, nprobe=MAX_NPROBE, ef_search=MAX_EF_SEARCH).item_ids for u in users])
    assert faiss_index.recall(wide, truth) >= faiss_index.recall(found, truth) - 1e-9


def test_retrieve_rejects_bad_requests(cores) -> None:
    features, retrieval = cores
    user = features.augment_user(0)
    for k in (-1, features.num_items + 1, 10_001):
        with pytest.raises(BadRequest, match="k must be"):
            retrieval.retrieve(user, k)
    # k 0 is the stage's default: 500, or the whole catalogue when it is smaller
    assert retrieval.retrieve(user, 0).item_ids.shape == (min(500, features.num_items),)
    with pytest.raises(BadRequest, match=r"nprobe must be in 0\.\.4096"):
        retrieval.retrieve(user, 10, nprobe=MAX_NPROBE + 1)
    with pytest.raises(BadRequest):
        retrieval.retrieve(user, 10, nprobe=-1)
    with pytest.raises(BadRequest):
        retrieval.retrieve(UserFeatures(0, user.dense[:3], user.sparse, user.recent_items), 10)
    with pytest.raises(BadRequest):
        retrieval.retrieve(UserFeatures(0, user.dense, user.sparse + 10**9, user.recent_items), 10)
    with pytest.raises(BadRequest):
        retrieval.retrieve(UserFeatures(0, np.full_like(user.dense, np.inf), user.sparse, user.recent_items), 10)


def test_torch_exact_backend_matches_flat(data) -> None:
    items, queries = data
    exact = faiss_index.TorchExactSearch(items, torch.device("cpu"))
    scores, ids = exact.search(torch.from_numpy(queries[:5]), 50)
    flat, _ = faiss_index.build(items, "flat")
    f_scores, f_ids = flat.search(queries[:5], 50)
    assert faiss_index.recall(ids, f_ids) > 0.99
    np.testing.assert_allclose(scores, f_scores, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_retrieval(cores, small_models: Path) -> None:
    features, _ = cores
    for precision in ("auto", "fp32"):  # auto: fp16 torch exact search + fp32 re-score on CUDA
        gpu = RetrievalCore.load(small_models, device="cuda", precision=precision)
        backend = gpu.details["backend"]
        assert gpu.device.startswith("cuda:")
        assert backend.startswith("torch-exact-fp16") if precision == "auto" else backend in ("faiss-gpu", "torch-exact")
        found = gpu.retrieve(features.augment_user(2), 50)
        assert len(np.unique(found.item_ids)) == 50


def test_a_batch_of_queries_finds_what_each_finds_alone(cores) -> None:
    from recpipe.retrieval.contract import RetrieveQuery

    features, retrieval = cores
    queries = []
    for user_id, k, nprobe in ((0, 50, 0), (1, 50, 0), (2, 10, 0), (3, 50, 4), (4, 0, 0), (5, 50, 0)):
        user = features.augment_user(user_id)
        queries.append(RetrieveQuery.checked(user.dense, user.sparse, k, retrieval.limits, nprobe=nprobe))
    together = retrieval.retrieve_batch(queries)
    for q, found in zip(queries, together, strict=True):
        alone = retrieval.retrieve_batch([q])[0]
        assert found.item_ids.tolist() == alone.item_ids.tolist()
        np.testing.assert_allclose(found.scores, alone.scores, rtol=1e-5, atol=1e-6)
