"""The GPU fast path and its CPU twins: bucketing/padding (what CUDA graphs replay), half-precision exact
retrieval with the fp32 re-score, pinned staging, NVTX, host-memory tables, and their flags.

The CPU tests run the same code as the GPU with ``device=cpu`` (padded shapes run eagerly, fp16 tables
scanned by torch on the CPU); the ``gpu`` tests check graph replay against eager mode, the pinned and
host-mapped paths, and skip cleanly without a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recpipe.accel.cuda_graphs import GraphRunner, bucket, mode_for
from recpipe.accel.transfer import DeviceIO, host_mapped
from recpipe.cli import main
from recpipe.errors import UsageError
from recpipe.features.core import FeatureCore
from recpipe.ranking.core import RankingCore
from recpipe.ranking.model import DLRM, DLRMConfig
from recpipe.ranking.predictor import MIN_ROWS_BUCKET, Predictor
from recpipe.retrieval import index as faiss_index
from recpipe.retrieval.contract import RetrieveQuery
from recpipe.retrieval.core import RetrievalCore
from recpipe.serving import nvtx

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


# ---- bucketing and the graph runner ------------------------------------------------------------------


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


def test_device_io_on_the_cpu_copies_only_to_pad() -> None:
    io = DeviceIO(torch.device("cpu"))
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    same = io.put("a", a, np.float32)
    assert same.data_ptr() == a.ctypes.data  # unpadded on the CPU: the array itself
    padded = io.put("a", a, np.float32, rows=8)
    assert padded.shape == (8, 3) and not padded.is_pinned()
    np.testing.assert_array_equal(padded[:4].numpy(), a)
    assert (padded[4:] == 0).all()
    io.put("a", a[:1] + 100, np.float32, rows=8)  # the buffer is reused and re-zeroed
    assert padded[0, 0] == 100 and (padded[1:] == 0).all()
    out = io.fetch("out", torch.arange(8.0), 5)
    np.testing.assert_array_equal(out, np.arange(5.0))
    with io.stream():  # no stream on the CPU: a no-op
        pass


@pytest.fixture(scope="module")
def features(small_models: Path, small_dataset: Path) -> FeatureCore:
    return FeatureCore.load(small_models, small_dataset)


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


# ---- half-precision exact retrieval -------------------------------------------------------------------


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
    assert sorted(padded._searches) == [16, 64, 128] and not eager._tower.padded


# ---- NVTX ------------------------------------------------------------------------------------------------


def test_nvtx_ranges_are_a_shared_null_context_when_off() -> None:
    assert not nvtx.enabled()
    assert nvtx.range("rank.compute") is nvtx.range("rank.queue")
    with nvtx.range("rank.compute"):
        pass
    assert nvtx.start("rank.queue") is None
    nvtx.end(None)
    assert nvtx.step_prefix("ranking.Rank") == "rank"
    assert nvtx.step_prefix("features.AugmentItems") == "augment_items"
    assert nvtx.step_prefix("retrieval.Retrieve") == "retrieve"


@no_cuda_only
def test_nvtx_without_cuda_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--nvtx needs CUDA"):
        nvtx.enable()
    assert not nvtx.enabled()


# ---- host-memory tables ----------------------------------------------------------------------------------


def test_host_tables_need_cuda(small_models: Path) -> None:
    with pytest.raises(UsageError, match="--embeddings host needs a CUDA device"):
        host_mapped(torch.zeros(3, 2), torch.device("cpu"))
    with pytest.raises(UsageError, match="--embeddings host needs a CUDA device"):
        RankingCore.load(small_models, device="cpu", embeddings="host")
    with pytest.raises(UsageError, match="--embeddings must be"):
        RankingCore.load(small_models, device="cpu", embeddings="disk")


# ---- flags -----------------------------------------------------------------------------------------------


def one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recpipe: error:") and needle in err[0], err


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


# ---- on a GPU --------------------------------------------------------------------------------------------


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
def test_host_mapped_tensor_is_read_in_place_by_the_gpu() -> None:
    dev = torch.device("cuda:0")
    src = torch.randn(1000, 16)
    view = host_mapped(src, dev)
    assert view.device.type == "cuda"
    ids = torch.tensor([0, 5, 999], device=dev)
    torch.testing.assert_close(torch.nn.functional.embedding(ids, view).cpu(), src[[0, 5, 999]])
    io = DeviceIO(dev)
    host = io.put("x", np.ones((3, 2), np.float32), np.float32, rows=4)
    assert host.is_pinned() and host.shape == (4, 2)
    with io.stream():
        out = io.fetch("y", io.to_device(host) * 2, 3)
    np.testing.assert_array_equal(out, np.full((3, 2), 2.0, np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_nvtx_enable_on_cuda() -> None:
    try:
        nvtx.enable()
        with nvtx.range("rank.compute"):
            handle = nvtx.start("rank.queue")
        nvtx.end(handle)
    finally:
        nvtx.disable()


def test_batcher_ranges_open_and_close_in_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVTX calls themselves recorded on the CPU (torch's range_start/range_end stubbed)."""
    import asyncio

    from recpipe.serving.batcher import BatchConfig, Batcher

    opened: dict[int, str] = {}
    closed: list[int] = []

    def range_start(name: str) -> int:
        opened[len(opened)] = name
        return len(opened) - 1

    monkeypatch.setattr(torch.cuda.nvtx, "range_start", range_start)
    monkeypatch.setattr(torch.cuda.nvtx, "range_end", closed.append)
    monkeypatch.setattr(nvtx, "_enabled", True)

    async def go() -> list[int]:
        batcher = Batcher("ranking.Rank", lambda qs: [q * 2 for q in qs], BatchConfig(max_batch=4))
        answers = await asyncio.gather(*(batcher.submit(i) for i in range(6)))
        with nvtx.range("rank.encode"):
            pass
        await batcher.close()
        return [a.value for a in answers]

    assert asyncio.run(go()) == [0, 2, 4, 6, 8, 10]
    assert sorted(closed) == sorted(opened) and len(closed) == len(set(closed))
    names = list(opened.values())
    assert names.count("rank.queue") == 6 and names.count("rank.compute") >= 2 and "rank.encode" in names


def test_getinfo_reports_the_fast_path_settings(serving_chain) -> None:
    from recpipe.client import RecommendClient

    with RecommendClient(serving_chain.ranking.address) as client:
        ranking = client.info().details
    with RecommendClient(serving_chain.retrieval.address) as client:
        retrieval = client.info().details
    assert ranking["cuda_graphs"] == "eager" and ranking["embeddings"] == "device"
    assert ranking["graphs_captured"] == "0"
    assert retrieval["precision"] == "fp32" and retrieval["cuda_graphs"] == "eager"
