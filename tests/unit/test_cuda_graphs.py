"""Bucketing and padding (what CUDA graphs replay): the CPU twins run padded shapes eagerly; the
``gpu`` test checks graph replay against eager mode.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fast_path_support import CUDA, batch_inputs, small_model

from recpipe.accel.cuda_graphs import GraphRunner, bucket, mode_for
from recpipe.features.core import FeatureCore
from recpipe.ranking.core import RankingCore
from recpipe.ranking.predictor import MIN_ROWS_BUCKET, Predictor
from recpipe.retrieval.contract import RetrieveQuery
from recpipe.retrieval.core import RetrievalCore


def test_buckets_are_the_next_power_of_two_above_a_floor() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 500, 512, 513)] == [1, 1, 2, 4, 8, 512, 512, 1024]
    assert bucket(3, 64) == 64 and bucket(100, 64) == 128


def test_graph_mode_is_cuda_only() -> None:
    cpu = torch.device("cpu")
    assert mode_for(cpu, True) == "eager" and mode_for(cpu, False) == "eager"
    assert mode_for(torch.device("cuda:0"), True) == "graph"
    assert mode_for(torch.device("cuda:0"), False) == "padded"
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GraphRunner(torch.relu, cpu, "graph")
    with pytest.raises(ValueError, match="unknown graph mode"):
        GraphRunner(torch.relu, cpu, "fast")


@pytest.mark.parametrize("counts", [[1], [37], [500], [3, 9], [5, 1, 20], [200, 300, 1, 1, 64]])
def test_padded_predictor_equals_unpadded(counts: list[int]) -> None:
    """The CPU twin of the ranking graphs: padded to (bucket(B), bucket(N)) and sliced back."""
    eager = Predictor(small_model(), torch.device("cpu"), "eager")
    padded = Predictor(small_model(), torch.device("cpu"), "padded")
    for p in (eager, padded):
        p.set_user_tables(4)
    # the twin keeps CUDA's item x item layout (the full Gram matrix); the eager CPU form takes its triangle
    assert (eager.gram_pairs, padded.gram_pairs) == (True, False)
    args = batch_inputs(counts)
    want = eager.score_batch(*args, counts)
    got = padded.score_batch(*args, counts)
    assert got.shape == (sum(counts),) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert bucket(sum(counts), MIN_ROWS_BUCKET) >= sum(counts)
    # each user's candidates alone give the same scores as in the padded batch (no leakage across users)
    ud, us, idn, isp = args
    start = 0
    for u, c in enumerate(counts):
        alone = padded.score_batch(ud[u : u + 1], us[u : u + 1], idn[start : start + c], isp[start : start + c], [c])
        np.testing.assert_allclose(alone, got[start : start + c], rtol=1e-5, atol=1e-6)
        start += c


def test_ranking_core_padded_equals_default(features: FeatureCore, small_models: Path) -> None:
    default = RankingCore.load(small_models, device="cpu")
    padded = RankingCore.load(small_models, device="cpu", graphs="padded")
    assert default.predictor.graphs == "eager" and padded.details["cuda_graphs"] == "padded"
    assert default.details["embeddings"] == "device"
    from recpipe.ranking.contract import RankQuery

    queries = []
    for uid, k in ((1, 30), (2, 1), (3, 77)):
        user, items = features.augment_user(uid), features.augment_items(uid, np.arange(k))
        queries.append(RankQuery.checked(user.dense, user.sparse, items.dense, items.sparse, default.limits))
    for got, want in zip(padded.rank_batch(queries), default.rank_batch(queries), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_retrieval_tower_padded_equals_default(features: FeatureCore, small_models: Path) -> None:
    default = RetrievalCore.load(small_models, device="cpu")
    padded = RetrievalCore.load(small_models, device="cpu", graphs="padded")
    assert default.details["cuda_graphs"] == "eager" and padded.details["cuda_graphs"] == "padded"
    users = [features.augment_user(u) for u in range(5)]
    dense, sparse = np.stack([u.dense for u in users]), np.stack([u.sparse for u in users])
    got = padded.query_embeddings(dense, sparse)
    assert got.shape == (5, default.spec.dim)  # padded to 8 rows inside, sliced back
    torch.testing.assert_close(got, default.query_embeddings(dense, sparse), rtol=1e-5, atol=1e-6)
    queries = [RetrieveQuery.checked(u.dense, u.sparse, 40, default.limits) for u in users]
    for a, b in zip(padded.retrieve_batch(queries), default.retrieve_batch(queries), strict=True):
        np.testing.assert_array_equal(a.item_ids, b.item_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("counts", [[1], [500], [3, 9], [200, 300, 1, 1, 64]])
def test_graph_replay_equals_eager_on_cuda(counts: list[int]) -> None:
    dev = torch.device("cuda:0")
    eager = Predictor(small_model(), dev, "eager")
    graph = Predictor(small_model(), dev, "graph")
    for p in (eager, graph):
        p.set_user_tables(4)
    args = batch_inputs(counts)
    want = eager.score_batch(*args, counts)
    for _ in range(3):  # capture, then replays
        np.testing.assert_allclose(graph.score_batch(*args, counts), want, rtol=1e-5, atol=1e-6)
    assert graph.graphs_captured == 1
    other = batch_inputs(counts, seed=7)  # new inputs through the same graph
    np.testing.assert_allclose(graph.score_batch(*other, counts), eager.score_batch(*other, counts),
                               rtol=1e-5, atol=1e-6)
