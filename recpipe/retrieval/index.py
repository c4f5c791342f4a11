"""FAISS indexes over the item embeddings (inner product), their tuning, and an exact torch backend.

- ``flat``: exact search (IndexFlatIP).
- ``ivf``: IndexIVFFlat with nlist in 4√N..16√N (fewer when N is too small to train that many
  centroids); ``nprobe`` tuned at train time to the smallest value reaching the recall target.
- ``hnsw``: IndexHNSWFlat (M=32); ``efSearch`` tuned the same way (never below k).
- ``ivfsq8``: ``IVF{nlist},SQ8``: the same inverted file over 8-bit scalar-quantized vectors (a
  quarter of the bytes to scan and hold); ``nprobe`` tuned as for ``ivf``.
- ``ivfpqfs``: ``IVF{nlist},PQ{d}x4fs,RFlat``: IVF over 4-bit PQ codes (one dimension per
  sub-quantizer; two per code were too coarse on the project's embeddings: recall@500 stalled at
  0.92) scanned with SIMD lookup tables (fast-scan), the top ``k_factor`` x k re-scored exactly from
  the stored vectors (IndexRefineFlat); ``nprobe`` and ``k_factor`` tuned together.
``auto`` builds the candidates, tunes each on recall@k at the serving k (500) against exact search,
keeps those reaching the target and picks the fastest single-query search at that k. Each spec
records recall at k = 100 and 500, build seconds and the index's bytes.

``TorchExactSearch`` (matmul + topk) is the exact reference and the backend on CUDA devices when the
installed faiss has no GPU support. Only it and the exact references import torch, when called: the
FAISS path of a CPU stage never loads it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faiss
import numpy as np

from recpipe.errors import ArtifactMismatch

if TYPE_CHECKING:
    import torch

INDEX_KINDS = ("flat", "ivf", "ivfsq8", "ivfpqfs", "hnsw")
#: kinds searched through an inverted file: ``nprobe`` applies
IVF_KINDS = ("ivf", "ivfsq8", "ivfpqfs")
HNSW_M = 32
#: the k the stage serves (its default candidate count): tuning and timing happen at this k
SERVE_K = 500
#: auto skips HNSW above this many items: its build alone would eat the training time budget on 2 cores
AUTO_HNSW_MAX_ITEMS = 300_000
#: refine depths tried for ``ivfpqfs``: the fast-scan returns k_factor x k, re-scored exactly
K_FACTORS = (2, 4, 8)
_NPROBES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_EF_SEARCHES = (16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 1024, 1536, 2048)


@dataclass(frozen=True)
class IndexSpec:
    """What was built and how to search it. ``nprobe``/``ef_search``/``k_factor``: tuned defaults;
    ``max_*``: request bounds. ``tuned_k``: the k the recall target was met at; ``search_ms_p50``: one
    query at k = 500 (``search_ms_p50_at_100``: at k = 100); ``index_bytes``: the serialized index, what
    a loaded one holds in memory."""

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
    # added with ivfpqfs; optional in index.json so older repositories still load
    k_factor: int = 0
    pq_m: int = 0
    tuned_k: int = 100
    recall_at_500: float = 0.0
    search_ms_p50_at_100: float = 0.0
    build_s: float = 0.0
    index_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "index.json") -> IndexSpec:
        optional = {f.name for f in fields(cls)[_FIRST_OPTIONAL:]}
        try:
            spec = cls(**{k: type(v)(data[k]) for k, v in asdict(cls("flat", 0, 0)).items()
                          if k in data or k not in optional})
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactMismatch(f"{source}: malformed index spec ({e!r})") from None
        if spec.kind not in INDEX_KINDS:
            raise ArtifactMismatch(f"{source}: unknown index kind {spec.kind!r}")
        return spec


_FIRST_OPTIONAL = [f.name for f in fields(IndexSpec)].index("k_factor")


def default_nlist(n: int) -> int:
    """4√N, but no more than N/40 (FAISS wants at least 39 training points per centroid)."""
    return max(1, min(round(4 * math.sqrt(n)), n // 40))


def pq_subquantizers(d: int) -> int:
    """4-bit PQ over one dimension per sub-quantizer (fast-scan wants an even count)."""
    return d + d % 2


def _untrained_ivf(kind: str, d: int, nlist: int) -> faiss.Index:
    """An empty IVF index of ``kind`` (inner product) whose coarse quantizer is an IndexFlatIP."""
    if kind == "ivf":
        return faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
    if kind == "ivfsq8":
        return faiss.index_factory(d, f"IVF{nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
    return faiss.index_factory(d, f"IVF{nlist},PQ{pq_subquantizers(d)}x4fs,RFlat", faiss.METRIC_INNER_PRODUCT)


def _train_ivf(index: faiss.Index, x: np.ndarray, nlist: int, seed: int) -> None:
    ivf = faiss.extract_index_ivf(index)
    ivf.cp.seed = seed
    # k-means is the cost of an IVF build; fewer iterations over a sample lose little recall, and
    # the recall target is met by tuning nprobe anyway
    ivf.cp.niter = 10
    n = x.shape[0]
    rng = np.random.default_rng(seed)
    index.train(x if n <= nlist * 40 else x[np.sort(rng.choice(n, nlist * 40, replace=False))])


def train_centroids(embeddings: np.ndarray, seed: int = 0) -> np.ndarray:
    """(nlist, d): the coarse k-means of an IVF build over ``embeddings`` with ``seed``, alone.

    Every IVF kind runs the same k-means (same sample, seed and iterations); ``build(..., centroids=)``
    takes its result, so ``auto`` clusters once for the three kinds instead of three times."""
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    n, d = x.shape
    nlist = default_nlist(n)
    index = _untrained_ivf("ivf", d, nlist)
    _train_ivf(index, x, nlist, seed)
    quantizer = faiss.extract_index_ivf(index).quantizer
    return np.asarray(quantizer.reconstruct_n(0, quantizer.ntotal), dtype=np.float32)


def build(
    embeddings: np.ndarray, kind: str, seed: int = 0, centroids: np.ndarray | None = None
) -> tuple[faiss.Index, int]:
    """(index, nlist) over ``embeddings`` (N, d) float32, inner-product metric. ``centroids`` (IVF
    kinds): the coarse k-means already run (``train_centroids``); the build then trains only its codes."""
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    n, d = x.shape
    if kind == "flat":
        index: faiss.Index = faiss.IndexFlatIP(d)
        index.add(x)
        return index, 0
    if kind in IVF_KINDS:
        nlist = default_nlist(n)
        index = _untrained_ivf(kind, d, nlist)
        if centroids is not None:
            if centroids.shape != (nlist, d):
                raise ValueError(f"centroids are {centroids.shape}, this build needs ({nlist}, {d})")
            # a quantizer that already holds nlist centroids is not trained again (faiss's Level1Quantizer)
            faiss.extract_index_ivf(index).quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
        _train_ivf(index, x, nlist, seed)
        index.add(x)
        return index, nlist
    if kind == "hnsw":
        hnsw = faiss.IndexHNSWFlat(d, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        hnsw.add(x)
        return hnsw, 0
    raise ValueError(f"unknown index kind {kind!r}")


def _hnsw(index: faiss.Index) -> Any:
    return faiss.downcast_index(index).hnsw  # type: ignore[attr-defined]


def set_search_params(index: faiss.Index, spec: IndexSpec, nprobe: int = 0, ef_search: int = 0, k: int = 0,
                      k_factor: int = 0) -> None:
    if spec.kind in IVF_KINDS:
        faiss.extract_index_ivf(index).nprobe = nprobe or spec.nprobe
    if spec.kind == "ivfpqfs":
        faiss.downcast_index(index).k_factor = float(k_factor or spec.k_factor or 1)  # type: ignore[attr-defined]
    elif spec.kind == "hnsw":
        _hnsw(index).efSearch = max(ef_search or spec.ef_search, k)


def exact_topk(queries: np.ndarray, embeddings: np.ndarray | torch.Tensor, k: int, batch: int = 1024) -> np.ndarray:
    """(Q, k) exact top-k ids by inner product (torch matmul + topk), the reference for recall."""
    import torch

    items = torch.as_tensor(embeddings)
    out = []
    for start in range(0, queries.shape[0], batch):
        q = torch.as_tensor(queries[start : start + batch], device=items.device)
        out.append(torch.topk(q @ items.T, k, dim=1).indices.cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, k), np.int64)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each row of ``truth`` that appears in the same row of ``found`` (-1: no result)."""
    if truth.size == 0:
        return 1.0
    if found.size == 0:
        return 0.0
    # ids made unique per row by an offset, then one sorted lookup (np.isin hashed both sides: 8x slower)
    span = int(max(found.max(initial=0), truth.max(initial=0))) + 2
    rows = np.arange(truth.shape[0], dtype=np.int64)[:, None] * span
    keys = np.sort(np.where(found >= 0, found.astype(np.int64) + rows, -1), axis=None)
    wanted = (truth.astype(np.int64) + rows).ravel()
    at = np.minimum(np.searchsorted(keys, wanted), keys.size - 1)
    return float(np.count_nonzero(keys[at] == wanted)) / truth.size


def _search_p50_ms(index: faiss.Index, queries: np.ndarray, k: int) -> float:
    times = []
    for q in queries:
        t0 = time.perf_counter_ns()
        index.search(q[None, :], k)
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) / 1e6


def index_bytes(index: faiss.Index) -> int:
    return int(faiss.serialize_index(index).nbytes)


def tune(
    index: faiss.Index,
    kind: str,
    nlist: int,
    embeddings: np.ndarray,
    queries: np.ndarray,
    target: float = 0.95,
    k: int = SERVE_K,
    timing_queries: int = 60,
    truth: np.ndarray | None = None,
) -> IndexSpec:
    """Smallest nprobe/efSearch (per refine depth for ``ivfpqfs``, then the fastest of those) whose
    recall@k against exact search reaches ``target`` on ``queries``; recall and latency are then
    recorded at k = 100 and k = 500 with the chosen parameters. ``truth``: the queries' exact top
    max(k, 500), when the caller already has it (``exact_topk``)."""
    n, d = embeddings.shape
    k = min(k, n)
    k100, k500 = min(100, n), min(SERVE_K, n)
    if kind != "flat" and (truth is None or truth.shape[1] < max(k, k500)):
        truth = exact_topk(queries, embeddings, max(k, k500))
    timing = queries[:timing_queries]

    def measure(spec: IndexSpec, kk: int) -> float:
        if kind == "flat" or truth is None:  # exact search is the reference itself
            return 1.0
        set_search_params(index, spec, k=kk)
        return recall(index.search(queries, kk)[1], truth[:, :kk])

    base = IndexSpec(kind, n, d, nlist=nlist, tuned_k=k)
    if kind in IVF_KINDS:
        steps = [p for p in _NPROBES if p < nlist] + [nlist]
        reached: list[IndexSpec] = []
        for kf in K_FACTORS if kind == "ivfpqfs" else (0,):
            last = -1.0
            # a deeper refine only pays with fewer probes than a shallower one already needed
            bound = min((s.nprobe for s in reached), default=nlist + 1)
            for p in (q for q in steps if q < bound):
                spec = IndexSpec(**{**asdict(base), "nprobe": p, "k_factor": kf,
                                    "pq_m": pq_subquantizers(d) if kf else 0})
                r = measure(spec, k)
                if r >= target:
                    reached.append(spec)
                    break
                # PQ codes cap the recall a refine depth can reach: more probes stop helping
                if kf and r - last < 0.001:
                    break
                last = r
        if not reached:  # nothing reached the target: the widest search tried
            reached = [spec]
        # refine depths trade nprobe for re-scoring: keep the fastest
        spec = min(reached, key=lambda s: _timed(index, s, timing, k)) if len(reached) > 1 else reached[0]
        spec = IndexSpec(**{**asdict(spec), "max_nprobe": min(nlist, max(4 * spec.nprobe, 64))})
    elif kind == "hnsw":
        for ef in _EF_SEARCHES:
            spec = IndexSpec(**{**asdict(base), "ef_search": max(ef, k)})
            if measure(spec, k) >= target:
                break
        spec = IndexSpec(**{**asdict(spec), "max_ef_search": max(4 * spec.ef_search, 1024)})
    else:
        spec = base
    r100, r500 = measure(spec, k100), measure(spec, k500)
    ms100, ms500 = _timed(index, spec, timing, k100), _timed(index, spec, timing, k500)
    set_search_params(index, spec)
    return IndexSpec(**{**asdict(spec), "recall_at_100": r100, "recall_at_500": r500, "search_ms_p50": ms500,
                        "search_ms_p50_at_100": ms100})


def _timed(index: faiss.Index, spec: IndexSpec, queries: np.ndarray, k: int) -> float:
    """p50 of one query at k, on one thread as a stage serves it (HNSW then searches with efSearch >= k):
    FAISS's OpenMP over two threads made a single fast-scan query ~10x slower on a loaded 2-core box."""
    set_search_params(index, spec, k=k)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        return _search_p50_ms(index, queries, k)
    finally:
        faiss.omp_set_num_threads(threads)


def candidate_kinds(n: int) -> list[str]:
    """What ``auto`` builds for ``n`` items (HNSW only where its build fits the training budget)."""
    return ["flat", *IVF_KINDS] + (["hnsw"] if n <= AUTO_HNSW_MAX_ITEMS else [])


def build_tuned(
    embeddings: np.ndarray,
    queries: np.ndarray,
    kind: str = "auto",
    target: float = 0.95,
    seed: int = 0,
    k: int = SERVE_K,
) -> tuple[faiss.Index, IndexSpec, list[IndexSpec]]:
    """Build ``kind`` (or, for ``auto``, every candidate) tuned to recall@k >= ``target``; return the
    chosen one (the fastest at k among those reaching it) and all tried."""
    n = embeddings.shape[0]
    kinds = candidate_kinds(n) if kind == "auto" else [kind]
    # one exact reference for every kind that needs one (flat is exact search itself)
    truth = exact_topk(queries, embeddings, min(max(k, SERVE_K), n)) if set(kinds) - {"flat"} else None
    # the IVF kinds share one k-means; each kind's build_s still counts it, as a build of that kind alone
    t0 = time.perf_counter()
    centroids = train_centroids(embeddings, seed) if any(k_ in IVF_KINDS for k_ in kinds) else None
    kmeans_s = time.perf_counter() - t0
    tried: list[tuple[faiss.Index, IndexSpec]] = []
    for kind_ in kinds:
        t0 = time.perf_counter()
        index, nlist = build(embeddings, kind_, seed, centroids if kind_ in IVF_KINDS else None)
        build_s = time.perf_counter() - t0 + (kmeans_s if kind_ in IVF_KINDS else 0.0)
        # tune a little above the target: the recall reported is measured on other queries
        spec = tune(index, kind_, nlist, embeddings, queries, min(1.0, target + 0.01), k, truth=truth)
        tried.append((index, IndexSpec(**{**asdict(spec), "build_s": round(build_s, 6),
                                          "index_bytes": index_bytes(index)})))
    good = [t for t in tried if _recall_at(t[1], k) >= target] or [t for t in tried if t[1].kind == "flat"] or tried
    index, spec = min(good, key=lambda t: t[1].search_ms_p50 if k >= SERVE_K else t[1].search_ms_p50_at_100)
    return index, spec, [s for _, s in tried]


def _recall_at(spec: IndexSpec, k: int) -> float:
    return spec.recall_at_500 if k >= SERVE_K else spec.recall_at_100


def save(index: faiss.Index, path: Path) -> None:
    faiss.write_index(index, str(path))


def load(path: Path, spec: IndexSpec, mmap: bool = True) -> faiss.Index:
    """Read the index; ``mmap`` maps the big arrays (IVF lists, flat and HNSW codes) from the file
    instead of reading them, where this faiss supports it for the kind, so a stage starts without
    reading the index through (pages come in as searches touch them)."""
    try:
        index = faiss.read_index(str(path), _io_flags(spec.kind) if mmap else 0)
    except RuntimeError as e:
        raise ArtifactMismatch(f"{path}: unreadable FAISS index ({str(e).splitlines()[0]})") from None
    if index.ntotal != spec.num_items or index.d != spec.dim:
        raise ArtifactMismatch(
            f"{path}: index holds {index.ntotal} x {index.d}, index.json says {spec.num_items} x {spec.dim}"
        )
    return index


def _io_flags(kind: str) -> int:
    """IO_FLAG_MMAP_IFC maps the codes of every kind here (flat, the IVF lists, HNSW's storage, the refine
    vectors) in this faiss. Measured at full scale (850k x 64, 214 MB IVF, 1 thread): read 18 ms mapped
    vs 270-330 ms read through, search unchanged (0.27 ms at k = 500). IO_FLAG_MMAP (the older
    on-disk inverted lists) read in 7 ms but made every IVF search 3-4x slower (0.92 ms): not used.
    The mapping keeps the file's inode: ``recpipe train --force`` swaps in a new directory, never
    rewrites a file in place."""
    del kind  # one flag for all kinds today; the kind stays in the signature for faiss versions that differ
    return int(getattr(faiss, "IO_FLAG_MMAP_IFC", 0))


#: ``--retrieval-precision``: the dtype the item embeddings are scanned in by ``TorchExactSearch``.
PRECISIONS = ("fp32", "fp16", "bf16")
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # torch's names


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
        import torch

        full = torch.as_tensor(np.ascontiguousarray(embeddings, dtype=np.float32), device=device)
        self.device = device
        self.precision = precision
        self.rescore = rescore if precision != "fp32" else 0
        self.items = full if precision == "fp32" else full.to(getattr(torch, _DTYPES[precision]))
        self.full = full if self.rescore else None

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])

    def search_tensors(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, D) queries -> (B, k) float32 scores, (B, k) int64 ids, on the device, scores descending."""
        q = queries.to(self.device, non_blocking=True).float()
        scan = q.to(self.items.dtype) @ self.items.T  # (B, N)
        if self.full is None:
            scores, ids = scan.topk(k, dim=1)
            return scores.float(), ids
        cand = scan.topk(min(self.num_items, self.rescore * k), dim=1).indices  # (B, r*k)
        exact = self.full[cand].bmm(q[:, :, None]).squeeze(-1)  # (B, r*k) fp32
        scores, pos = exact.topk(k, dim=1)
        return scores, cand.gather(1, pos)

    def search(self, queries: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores, ids = self.search_tensors(queries, k)
        return scores.float().cpu().numpy(), ids.cpu().numpy()


def half_recall(embeddings: np.ndarray, device: torch.device, precision: str, rescore: int, k: int = 500,
                queries: np.ndarray | None = None, num_queries: int = 256, seed: int = 0) -> float:
    """Recall@k of ``TorchExactSearch(precision, rescore)`` against the fp32 exact search, on ``queries``
    (default: ``num_queries`` item vectors drawn at random, a stand-in for users: same space, same norm)."""
    import torch

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
