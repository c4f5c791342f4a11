"""FAISS indexes against exact search, the tuner, the two-tower loss, and RetrievalCore."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

from recpipe.errors import ArtifactMismatch, BadRequest
from recpipe.features.core import FeatureCore
from recpipe.retrieval import index as faiss_index
from recpipe.retrieval.config import TwoTowerConfig
from recpipe.retrieval.contract import MAX_EF_SEARCH, MAX_NPROBE
from recpipe.retrieval.core import RetrievalCore
from recpipe.retrieval.model import TwoTower
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


@pytest.mark.parametrize("kind", faiss_index.INDEX_KINDS)
def test_tuned_index_reaches_recall_target_against_exact(kind: str, data) -> None:
    items, queries = data
    index, nlist = faiss_index.build(items, kind)
    spec = faiss_index.tune(index, kind, nlist, items, queries[:150], target=0.95)
    assert spec.tuned_k == 500
    for k, tuned in ((500, spec.recall_at_500), (100, spec.recall_at_100)):
        truth = faiss_index.exact_topk(queries[150:], items, k)
        faiss_index.set_search_params(index, spec, k=k)
        measured = faiss_index.recall(index.search(queries[150:], k)[1], truth)
        assert measured >= 0.93  # held-out queries: close to the tuned recall
        if kind == "flat":
            assert measured > 0.999
        if k == 500:
            assert tuned >= 0.95
    assert spec.search_ms_p50 > 0 and spec.search_ms_p50_at_100 > 0
    if kind in faiss_index.IVF_KINDS:
        assert 1 <= spec.nprobe <= spec.max_nprobe <= nlist
        assert nlist == faiss_index.default_nlist(len(items))
    if kind == "ivfpqfs":
        assert spec.k_factor in faiss_index.K_FACTORS and spec.pq_m == items.shape[1]
        assert faiss.downcast_index(index).k_factor == spec.k_factor
    if kind == "hnsw":
        assert 500 <= spec.ef_search <= spec.max_ef_search


def test_auto_picks_the_fastest_index_reaching_the_target_at_k500(data) -> None:
    items, queries = data
    _, spec, tried = faiss_index.build_tuned(items, queries[:150], "auto", 0.95)
    assert [s.kind for s in tried] == ["flat", "ivf", "ivfsq8", "ivfpqfs", "hnsw"]
    assert spec.recall_at_500 >= 0.95
    assert spec.search_ms_p50 == min(s.search_ms_p50 for s in tried if s.recall_at_500 >= 0.95)
    # build time and memory are recorded for every kind; the 4-bit and 8-bit codes hold less than flat
    assert all(s.build_s > 0 and s.index_bytes > 0 for s in tried)
    size = {s.kind: s.index_bytes for s in tried}
    assert size["ivfsq8"] < size["ivf"] and size["ivfpqfs"] > size["ivf"]  # PQ codes + the refine vectors


@pytest.mark.parametrize("kind", faiss_index.IVF_KINDS)
def test_shared_centroids_build_the_same_index_as_its_own_kmeans(kind: str, data) -> None:
    # auto clusters once for the three IVF kinds: what each then holds and finds must not change
    items, queries = data
    alone, nlist = faiss_index.build(items, kind, seed=3)
    centroids = faiss_index.train_centroids(items, seed=3)
    shared, nlist_shared = faiss_index.build(items, kind, seed=3, centroids=centroids)
    assert nlist_shared == nlist and centroids.shape == (nlist, items.shape[1])
    quantizer = faiss.extract_index_ivf(alone).quantizer
    np.testing.assert_array_equal(quantizer.reconstruct_n(0, nlist), centroids)
    spec = faiss_index.tune(alone, kind, nlist, items, queries[:100], target=0.95)
    for index in (alone, shared):
        faiss_index.set_search_params(index, spec, k=500)
    np.testing.assert_array_equal(shared.search(queries[100:160], 500)[1], alone.search(queries[100:160], 500)[1])
    with pytest.raises(ValueError, match="centroids are"):
        faiss_index.build(items, kind, centroids=centroids[:-1])


def test_recall_counts_each_row_against_its_own_truth() -> None:
    rng = np.random.default_rng(0)
    truth = np.stack([rng.choice(1000, 50, replace=False) for _ in range(40)])
    found = np.where(rng.random(truth.shape) < 0.8, truth, rng.integers(-1, 1000, truth.shape))
    found = rng.permuted(found, axis=1)
    expected = np.mean([len(set(t) & set(f[f >= 0])) for t, f in zip(truth, found, strict=True)]) / truth.shape[1]
    assert faiss_index.recall(found, truth) == pytest.approx(expected)
    assert faiss_index.recall(np.roll(truth, 1, axis=0), truth) < 0.2  # another row's ids do not count
    assert faiss_index.recall(np.full_like(truth, -1), truth) == 0.0
    assert faiss_index.recall(truth[:, :0], truth) == 0.0 and faiss_index.recall(found, truth[:0]) == 1.0


def test_index_spec_reads_an_older_index_json_without_the_new_fields() -> None:
    old = {"kind": "ivf", "num_items": 10, "dim": 4, "nlist": 2, "nprobe": 1, "max_nprobe": 2, "ef_search": 0,
           "max_ef_search": 0, "recall_at_100": 0.97, "search_ms_p50": 0.3}
    spec = faiss_index.IndexSpec.from_json(old)
    assert (spec.kind, spec.nprobe, spec.k_factor, spec.tuned_k, spec.index_bytes) == ("ivf", 1, 0, 100, 0)
    with pytest.raises(ArtifactMismatch, match="malformed"):
        faiss_index.IndexSpec.from_json({k: v for k, v in old.items() if k != "nprobe"})
    with pytest.raises(ArtifactMismatch, match="unknown index kind"):
        faiss_index.IndexSpec.from_json({**old, "kind": "lsh"})


@pytest.mark.parametrize("kind", ["ivfsq8", "ivfpqfs", "hnsw", "ivf", "flat"])
def test_index_file_round_trips_through_faiss_format(kind: str, data, tmp_path: Path) -> None:
    items, queries = data
    index, nlist = faiss_index.build(items, kind)
    spec = faiss_index.tune(index, kind, nlist, items, queries[:100], target=0.95)
    faiss_index.save(index, tmp_path / "index.faiss")
    for mmap in (True, False):
        loaded = faiss_index.load(tmp_path / "index.faiss", spec, mmap=mmap)
        for k in (100, 500):
            faiss_index.set_search_params(index, spec, k=k)
            faiss_index.set_search_params(loaded, spec, k=k)
            np.testing.assert_array_equal(loaded.search(queries[100:140], k)[1], index.search(queries[100:140], k)[1])
    with pytest.raises(ArtifactMismatch, match=r"index\.json says"):
        faiss_index.load(tmp_path / "index.faiss", faiss_index.IndexSpec(kind, len(items) + 1, items.shape[1]))


def test_folded_user_tower_is_the_torch_tower() -> None:
    from recpipe.retrieval.model import Tower

    torch.manual_seed(0)
    tower = Tower(5, (3, 7, 2), 4, (16, 8), 6).eval()
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(9, 5)).astype(np.float32)
    sparse = np.stack([rng.integers(0, n, 9) for n in (3, 7, 2)], axis=1).astype(np.int64)
    with torch.inference_mode():
        want = tower(torch.from_numpy(dense), torch.from_numpy(sparse)).numpy()
    got = tower.folded()(dense, sparse)
    assert got.dtype == np.float32 and got.shape == (9, 6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # an input that overflows float32 comes out NaN or zero (reported as degenerate), as in torch
    from recpipe.finite import degenerate

    huge = tower.folded()(np.full((1, 5), 3e38, np.float32), sparse[:1])
    assert degenerate(np.linalg.norm(huge, axis=1)).all()


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
    assert retrieval.details["index_type"] in faiss_index.INDEX_KINDS
    assert retrieval.details["user_tower"] == "folded-numpy"
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
