"""DLRM modules, the factorised predictor, and RankingCore over a trained repository."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recpipe.errors import BadRequest
from recpipe.features.core import FeatureCore
from recpipe.ranking.core import RankingCore
from recpipe.ranking.model import DLRM, DLRMConfig, InteractionArch, NaiveSparseArch
from recpipe.ranking.predictor import Predictor
from recpipe.types import ItemFeatures, UserFeatures

SIZES = (7, 3, 11, 5, 2, 9)  # 4 "user" + 2 "item" tables


def small_model(seed: int = 0) -> DLRM:
    torch.manual_seed(seed)
    return DLRM(DLRMConfig(user_dense_dim=5, item_dense_dim=4, table_sizes=SIZES, embedding_dim=8,
                           bottom_dims=(16,), top_dims=(32, 8))).eval()


def random_inputs(b: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sparse = torch.stack([torch.randint(0, n, (b,), generator=g) for n in SIZES], dim=1)
    return torch.randn(b, 9, generator=g), sparse


def test_forward_shapes_and_interaction_width() -> None:
    model = small_model()
    dense, sparse = random_inputs(10)
    assert model(dense, sparse).shape == (10,)
    inter = InteractionArch(num_vectors=4)
    out = inter(torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    assert out.shape == (3, 2 * 8 + 4 * 3 // 2)
    x = torch.randn(1, 4, 8)
    full = x[0] @ x[0].T
    expect = torch.cat([x[0, :2].flatten(), full[torch.triu_indices(4, 4, 1).unbind()]])
    torch.testing.assert_close(inter(x[:, :2], x[:, 2:])[0], expect)


def test_naive_per_table_bags_equal_the_fused_lookup() -> None:
    model = small_model()
    _, sparse = random_inputs(32)
    naive = NaiveSparseArch.from_fused(model.sparse_arch)
    assert len(naive.bags) == len(SIZES)
    torch.testing.assert_close(naive(sparse), model.sparse_arch(sparse))


def test_factorised_scoring_equals_the_plain_forward() -> None:
    model = small_model()
    predictor = Predictor(model, torch.device("cpu"))
    predictor.set_user_tables(4)
    dense, sparse = random_inputs(1)
    items_dense, items_sparse = random_inputs(25, seed=2)
    args = (dense[0, :5].numpy(), sparse[0, :4].numpy(), items_dense[:, 5:].numpy(), items_sparse[:, 4:].numpy())
    plain = predictor.score_candidates(*args, factorized=False)
    fast = predictor.score_candidates(*args)
    np.testing.assert_allclose(fast, plain, rtol=1e-5, atol=1e-6)
    full = predictor.predict(np.concatenate([np.repeat(args[0][None], 25, 0), args[2]], 1),
                             np.concatenate([np.repeat(args[1][None], 25, 0), args[3]], 1))
    np.testing.assert_allclose(plain, full, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def cores(small_models: Path, small_dataset: Path) -> tuple[FeatureCore, RankingCore]:
    return FeatureCore.load(small_models, small_dataset), RankingCore.load(small_models, device="cpu")


def test_rank_scores_candidates(cores) -> None:
    features, ranking = cores
    assert ranking.device == "cpu" and ranking.model_version == features.model_version
    user = features.augment_user(3)
    ids = np.arange(0, min(40, features.num_items))
    scores = ranking.rank(user, features.augment_items(3, ids))
    assert scores.shape == ids.shape and scores.dtype == np.float32
    assert ((scores > 0) & (scores < 1)).all()
    # scoring one item at a time gives the same scores (no cross-candidate leakage)
    single = np.concatenate([ranking.rank(user, features.augment_items(3, ids[i : i + 1])) for i in range(5)])
    np.testing.assert_allclose(single, scores[:5], rtol=1e-5, atol=1e-6)


def test_rank_rejects_malformed_features(cores) -> None:
    features, ranking = cores
    user = features.augment_user(0)
    items = features.augment_items(0, np.arange(5))
    bad_inputs = [
        (UserFeatures(0, user.dense[:-1], user.sparse, user.recent_items), items),
        (UserFeatures(0, user.dense, user.sparse[:-1], user.recent_items), items),
        (UserFeatures(0, user.dense, user.sparse + 10**9, user.recent_items), items),
        (user, ItemFeatures(items.item_ids, items.dense[:, :-1], items.sparse)),
        (user, ItemFeatures(items.item_ids, items.dense, items.sparse[:3])),
        (user, ItemFeatures(items.item_ids, items.dense, -items.sparse - 1)),
        (user, ItemFeatures(items.item_ids, np.full_like(items.dense, np.nan), items.sparse)),
    ]
    for u, it in bad_inputs:
        with pytest.raises(BadRequest):
            ranking.rank(u, it)
    with pytest.raises(BadRequest, match=r"expected 1\.\.10000 rows, got 0"):
        ranking.rank(user, ItemFeatures(items.item_ids[:0], items.dense[:0], items.sparse[:0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_scores_match_cpu(cores, small_models: Path) -> None:
    features, ranking = cores
    gpu = RankingCore.load(small_models, device="cuda")
    assert gpu.device.startswith("cuda:")
    user = features.augment_user(1)
    items = features.augment_items(1, np.arange(30))
    np.testing.assert_allclose(gpu.rank(user, items), ranking.rank(user, items), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("chunk_rows", [4096, 20])
def test_a_batch_of_requests_scores_as_each_alone(cores, chunk_rows, monkeypatch) -> None:
    from recpipe.ranking import core as ranking_core
    from recpipe.ranking.contract import RankQuery

    monkeypatch.setattr(ranking_core, "CHUNK_ROWS", chunk_rows)  # 20: the batch runs as several forwards
    features, ranking = cores
    rng = np.random.default_rng(4)
    queries = []
    for user_id, k in ((0, 7), (3, 1), (5, 40), (8, 13)):
        user = features.augment_user(user_id)
        items = features.augment_items(user_id, rng.choice(features.num_items, k, replace=False))
        queries.append(RankQuery.checked(user.dense, user.sparse, items.dense, items.sparse, ranking.limits))
    together = ranking.rank_batch(queries)
    for q, scores in zip(queries, together, strict=True):
        alone = ranking.rank_batch([q])[0]
        assert scores.shape == (q.k,)
        np.testing.assert_allclose(scores, alone, rtol=1e-5, atol=1e-6)


def test_both_ways_items_meet_their_users_give_the_same_scores(cores) -> None:
    # CUDA (graphs) gathers each item's user vectors; the CPU does one matmul per user: same scores
    features, ranking = cores
    rng = np.random.default_rng(7)
    counts = [5, 1, 30, 12]
    users = [features.augment_user(u) for u in range(len(counts))]
    items = [features.augment_items(u, rng.choice(features.num_items, k, replace=False)) for u, k in enumerate(counts)]
    args = (np.stack([u.dense for u in users]), np.stack([u.sparse for u in users]),
            np.concatenate([i.dense for i in items]), np.concatenate([i.sparse for i in items]), counts)
    split = ranking.predictor._split
    assert split is not None and split.gather_segments is False  # the CPU default
    per_user = ranking.predictor.score_batch(*args)
    split.gather_segments = True
    try:
        gathered = ranking.predictor.score_batch(*args)
    finally:
        split.gather_segments = False
    np.testing.assert_allclose(per_user, gathered, rtol=1e-5, atol=1e-6)


def test_both_item_gram_layouts_give_the_same_scores(cores) -> None:
    # The CPU forwards take the item x item dots' upper triangle; the CUDA forms (and a Predictor with full_gram) the
    # full Gram matrix with zero weights below it: the same scores, for one user and for a batch
    features, ranking = cores
    predictor = ranking.predictor
    assert predictor.gram_pairs is True  # the eager CPU default
    rng = np.random.default_rng(11)
    counts = [9, 1, 25]
    users = [features.augment_user(u) for u in range(len(counts))]
    items = [features.augment_items(u, rng.choice(features.num_items, k, replace=False)) for u, k in enumerate(counts)]

    twin = Predictor(predictor.model, predictor.device, full_gram=True)  # the same weights
    twin.set_user_tables(predictor.num_user_tables)
    assert twin.gram_pairs is False

    def scores(p: Predictor) -> list[np.ndarray]:
        batch = p.score_batch(np.stack([u.dense for u in users]), np.stack([u.sparse for u in users]),
                              np.concatenate([i.dense for i in items]), np.concatenate([i.sparse for i in items]), counts)
        alone = p.score_batch(users[0].dense[None], users[0].sparse[None], items[0].dense, items[0].sparse, counts[:1])
        return [batch, alone]

    pairs, full = scores(predictor), scores(twin)
    for a, b in zip(pairs, full, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # the triangle's block holds every nonzero weight of the full layout's
    split = predictor._split
    assert split.item_pair_first.weight.shape[1] == split.ni * (split.ni - 1) // 2
    assert torch.count_nonzero(split.item_item_first.weight) == torch.count_nonzero(split.item_pair_first.weight)
