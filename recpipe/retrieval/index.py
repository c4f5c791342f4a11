"""FAISS indexes over the item embeddings (inner product), their tuning, and an exact torch backend.

- ``flat``: exact search (IndexFlatIP).
- ``ivf``: IndexIVFFlat with nlist in 4√N..16√N (fewer when N is too small to train that many
  centroids); ``nprobe`` tuned at train time to the smallest value reaching the recall target.
- ``hnsw``: IndexHNSWFlat (M=32); ``efSearch`` tuned the same way.
``auto`` builds the candidates, keeps those whose tuned recall@100 against exact search reaches the
target, and picks the fastest single-query search among them.

``TorchExactSearch`` (matmul + topk) is the exact reference and the backend on CUDA devices when the
installed faiss has no GPU support.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from recpipe.errors import ArtifactMismatch

INDEX_KINDS = ("flat", "ivf", "hnsw")
HNSW_M = 32
#: auto skips HNSW above this many items: its build alone would eat the training time budget on 2 cores
AUTO_HNSW_MAX_ITEMS = 300_000


@dataclass(frozen=True)
class IndexSpec:
    """What was built and how to search it. ``nprobe``/``ef_search``: tuned defaults; ``max_*``: request bounds."""

    kind: str
    num_items: int
    dim: int
    nlist: int = 0
    nprobe: int = 0
    max_nprobe: int = 0
    ef_search: int = 0
    max_ef_search: int = 0
    recall_at_100: float = 1.0
    search_ms_p50: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "index.json") -> IndexSpec:
        try:
            spec = cls(**{k: type(v)(data[k]) for k, v in asdict(cls("flat", 0, 0)).items()})
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactMismatch(f"{source}: malformed index spec ({e!r})") from None
        if spec.kind not in INDEX_KINDS:
            raise ArtifactMismatch(f"{source}: unknown index kind {spec.kind!r}")
        return spec


def default_nlist(n: int) -> int:
    """4√N, but no more than N/40 (FAISS wants at least 39 training points per centroid)."""
    return max(1, min(round(4 * math.sqrt(n)), n // 40))


def build(embeddings: np.ndarray, kind: str, seed: int = 0) -> tuple[faiss.Index, int]:
    """(index, nlist) over ``embeddings`` (N, d) float32, inner-product metric."""
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    n, d = x.shape
    if kind == "flat":
        index: faiss.Index = faiss.IndexFlatIP(d)
        index.add(x)
        return index, 0
    if kind == "ivf":
        nlist = default_nlist(n)
        quantizer = faiss.IndexFlatIP(d)
        ivf = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.cp.seed = seed
        # k-means is the cost of an IVF build; fewer iterations over a sample lose little recall, and
        # the recall target is met by tuning nprobe anyway
        ivf.cp.niter = 10
        rng = np.random.default_rng(seed)
        sample = x if n <= nlist * 40 else x[np.sort(rng.choice(n, nlist * 40, replace=False))]
        ivf.train(sample)
        ivf.add(x)
        return ivf, nlist
    if kind == "hnsw":
        hnsw = faiss.IndexHNSWFlat(d, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        hnsw.add(x)
        return hnsw, 0
    raise ValueError(f"unknown index kind {kind!r}")


def _hnsw(index: faiss.Index) -> Any:
    return faiss.downcast_index(index).hnsw  # type: ignore[attr-defined]


def set_search_params(index: faiss.Index, spec: IndexSpec, nprobe: int = 0, ef_search: int = 0, k: int = 0) -> None:
    if spec.kind == "ivf":
        faiss.extract_index_ivf(index).nprobe = nprobe or spec.nprobe
    elif spec.kind == "hnsw":
        _hnsw(index).efSearch = max(ef_search or spec.ef_search, k)


def exact_topk(queries: np.ndarray, embeddings: np.ndarray | torch.Tensor, k: int, batch: int = 1024) -> np.ndarray:
    """(Q, k) exact top-k ids by inner product (torch matmul + topk), the reference for recall."""
    items = torch.as_tensor(embeddings)
    out = []
    for start in range(0, queries.shape[0], batch):
        q = torch.as_tensor(queries[start : start + batch], device=items.device)
        out.append(torch.topk(q @ items.T, k, dim=1).indices.cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, k), np.int64)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each row of ``truth`` that appears in the same row of ``found``."""
    if truth.size == 0:
        return 1.0
    # make ids unique per row, then one vectorised membership test
    span = int(max(found.max(initial=0), truth.max(initial=0))) + 2
    rows = np.arange(truth.shape[0], dtype=np.int64)[:, None] * span
    hits = np.isin(truth.astype(np.int64) + rows, np.where(found >= 0, found + rows, -1)).sum()
    return float(hits) / truth.size


def _search_p50_ms(index: faiss.Index, queries: np.ndarray, k: int) -> float:
    times = []
    for q in queries:
        t0 = time.perf_counter_ns()
        index.search(q[None, :], k)
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) / 1e6


def tune(
    index: faiss.Index,
    kind: str,
    nlist: int,
    embeddings: np.ndarray,
    queries: np.ndarray,
    target: float = 0.95,
    k: int = 100,
    timing_queries: int = 60,
) -> IndexSpec:
    """Smallest nprobe/efSearch whose recall@k against exact search reaches ``target`` on ``queries``."""
    n, d = embeddings.shape
    k = min(k, n)
    truth = exact_topk(queries, embeddings, k)
    spec = IndexSpec(kind, n, d, nlist=nlist)
    if kind == "ivf":
        steps = [p for p in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512) if p < nlist] + [nlist]
        for p in steps:
            faiss.extract_index_ivf(index).nprobe = p
            r = recall(index.search(queries, k)[1], truth)
            if r >= target or p == nlist:
                break
        spec = IndexSpec(kind, n, d, nlist=nlist, nprobe=p, max_nprobe=min(nlist, max(4 * p, 64)), recall_at_100=r)
    elif kind == "hnsw":
        hnsw = _hnsw(index)
        for ef in (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 2048):
            hnsw.efSearch = max(ef, k)
            r = recall(index.search(queries, k)[1], truth)
            if r >= target:
                break
        spec = IndexSpec(kind, n, d, ef_search=ef, max_ef_search=max(4 * ef, 1024), recall_at_100=r)
    else:
        r = recall(index.search(queries, k)[1], truth)
        spec = IndexSpec(kind, n, d, recall_at_100=r)
    # time what serving runs: k = 500 candidates (HNSW then searches with efSearch >= k)
    k_serve = min(500, n)
    set_search_params(index, spec, k=k_serve)
    ms = _search_p50_ms(index, queries[:timing_queries], k_serve)
    set_search_params(index, spec)
    return IndexSpec(**{**asdict(spec), "search_ms_p50": ms})


def build_tuned(
    embeddings: np.ndarray,
    queries: np.ndarray,
    kind: str = "auto",
    target: float = 0.95,
    seed: int = 0,
) -> tuple[faiss.Index, IndexSpec, list[IndexSpec]]:
    """Build ``kind`` (or, for ``auto``, every candidate) tuned to ``target``; return the chosen one and all tried."""
    n = embeddings.shape[0]
    kinds = ["flat", "ivf"] + (["hnsw"] if n <= AUTO_HNSW_MAX_ITEMS else []) if kind == "auto" else [kind]
    tried: list[tuple[faiss.Index, IndexSpec]] = []
    for k in kinds:
        index, nlist = build(embeddings, k, seed)
        # tune a little above the target: the recall reported is measured on other queries
        tried.append((index, tune(index, k, nlist, embeddings, queries, min(1.0, target + 0.01))))
    good = [t for t in tried if t[1].recall_at_100 >= target] or [t for t in tried if t[1].kind == "flat"] or tried
    index, spec = min(good, key=lambda t: t[1].search_ms_p50)
    return index, spec, [s for _, s in tried]


def save(index: faiss.Index, path: Path) -> None:
    faiss.write_index(index, str(path))


def load(path: Path, spec: IndexSpec) -> faiss.Index:
    try:
        index = faiss.read_index(str(path))
    except RuntimeError as e:
        raise ArtifactMismatch(f"{path}: unreadable FAISS index ({str(e).splitlines()[0]})") from None
    if index.ntotal != spec.num_items or index.d != spec.dim:
        raise ArtifactMismatch(
            f"{path}: index holds {index.ntotal} x {index.d}, index.json says {spec.num_items} x {spec.dim}"
        )
    return index


#: ``--retrieval-precision``: the dtype the item embeddings are scanned in by ``TorchExactSearch``.
PRECISIONS = ("fp32", "fp16", "bf16")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class TorchExactSearch:
    """Exact inner-product top-k with torch (matmul + topk), on any device, in fp32 or half precision.

    ``precision`` fp16/bf16 keeps the item embeddings in that dtype on the device: the scan reads half
    the bytes (the matmul of one query against all items is memory-bound). With ``rescore`` r > 0 the
    top r*k of the half-precision scan are scored again in fp32 (from an fp32 copy, gathered row by
    row) and the top k of those kept, so only items near the cut-off can be lost to rounding; scores
    returned are then exact fp32 inner products. ``rescore`` 0 returns the half-precision top k.
    """

    def __init__(self, embeddings: np.ndarray, device: torch.device, precision: str = "fp32",
                 rescore: int = 0) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: choose {', '.join(PRECISIONS)}")
        if rescore < 0:
            raise ValueError(f"rescore must be >= 0, got {rescore}")
        full = torch.as_tensor(np.ascontiguousarray(embeddings, dtype=np.float32), device=device)
        self.device = device
        self.precision = precision
        self.rescore = rescore if precision != "fp32" else 0
        self.items = full if precision == "fp32" else full.to(_DTYPES[precision])
        self.full = full if self.rescore else None

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])

    def search_tensors(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, D) queries -> (B, k) float32 scores, (B, k) int64 ids, on the device, scores descending."""
        q = queries.to(self.device, non_blocking=True).float()
        scan = q.to(self.items.dtype) @ self.items.T  # (B, N)
        if self.full is None:
            scores, ids = torch.topk(scan, k, dim=1)
            return scores.float(), ids
        cand = torch.topk(scan, min(self.num_items, self.rescore * k), dim=1).indices  # (B, r*k)
        exact = torch.bmm(self.full[cand], q[:, :, None]).squeeze(-1)  # (B, r*k) fp32
        scores, pos = torch.topk(exact, k, dim=1)
        return scores, cand.gather(1, pos)

    def search(self, queries: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores, ids = self.search_tensors(queries, k)
        return scores.float().cpu().numpy(), ids.cpu().numpy()


def half_recall(embeddings: np.ndarray, device: torch.device, precision: str, rescore: int, k: int = 500,
                queries: np.ndarray | None = None, num_queries: int = 256, seed: int = 0) -> float:
    """Recall@k of ``TorchExactSearch(precision, rescore)`` against the fp32 exact search, on ``queries``
    (default: ``num_queries`` item vectors drawn at random, a stand-in for users: same space, same norm)."""
    n = embeddings.shape[0]
    k = min(k, n)
    if queries is None:
        rng = np.random.default_rng(seed)
        queries = embeddings[np.sort(rng.choice(n, min(num_queries, n), replace=False))]
    q = torch.as_tensor(np.ascontiguousarray(queries, dtype=np.float32), device=device)
    half = TorchExactSearch(embeddings, device, precision, rescore)
    found = np.concatenate([half.search_tensors(q[i : i + 64], k)[1].cpu().numpy() for i in range(0, len(q), 64)])
    del half
    truth = exact_topk(np.ascontiguousarray(queries, dtype=np.float32),
                       torch.as_tensor(np.ascontiguousarray(embeddings, dtype=np.float32), device=device), k, batch=64)
    return recall(found, truth)
