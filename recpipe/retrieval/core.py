"""The retrieval core: user tower forward + top-k search over the item index.

Backends: the FAISS index on CPU; on a CUDA device the same index moved to the GPU when the
installed faiss has GPU support (flat, IVF), otherwise exact search with torch (matmul + topk) over
the item embeddings on the GPU.

``precision`` (``--retrieval-precision``): ``auto`` is fp16 exact search on a CUDA device (half the
bytes to scan, the top ``rescore`` x k re-scored in fp32) and the FAISS index on the CPU; ``fp32``
keeps the backends above; ``fp16``/``bf16`` use the torch exact search in that dtype on any device
(on the CPU: the twin of the GPU path that the tests run). Its recall@500 against the fp32 exact
search is measured at load and reported in ``details``. On CUDA the user tower replays a CUDA graph
per bucketed batch size (``cuda_graphs``), and transfers go through pinned buffers on one stream.

The FAISS index on the CPU runs the user tower folded into numpy, read from the repository without
torch: that core never imports torch (``load(device="cpu")``, or ``auto`` on a machine without a GPU
driver), so the stage serves a second or more sooner. Every other path loads the torch tower.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faiss
import numpy as np

from recpipe.accel import device as devices
from recpipe.accel.cuda_graphs import GraphRunner, bucket, mode_for
from recpipe.accel.traffic import KEY as TRAFFIC_KEY
from recpipe.accel.traffic import Traffic
from recpipe.config import DEFAULT_NUM_CANDIDATES
from recpipe.errors import ArtifactMismatch
from recpipe.finite import degenerate
from recpipe.repository import Repository
from recpipe.retrieval import artifacts
from recpipe.retrieval import index as faiss_index
from recpipe.retrieval.contract import RetrievalLimits, RetrieveQuery
from recpipe.retrieval.options import DEFAULT_RESCORE, RetrievalOptions
from recpipe.types import Candidates, UserFeatures

if TYPE_CHECKING:
    import torch

    from recpipe.accel.transfer import DeviceIO
    from recpipe.retrieval.model import Tower

_log = logging.getLogger(__name__)
#: Recall@k (k = 500) of the half-precision search against fp32 exact search it must reach.
HALF_RECALL_TARGET = 0.99


class RetrievalCore:
    """``retrieve(user, k)`` -> the k best item ids for the user, scores descending."""

    #: the torch path's transfers and user-tower runner (not set where the tower runs folded)
    io: DeviceIO
    _tower: GraphRunner

    def __init__(self, repo: Repository, dev: torch.device | str, *, cuda_graphs: bool = True,
                 precision: str = "auto", rescore: int = DEFAULT_RESCORE, graphs: str | None = None) -> None:
        """``dev``: a ``torch.device`` or its name ("cpu", "cuda:0"). ``graphs`` overrides the mode
        ``cuda_graphs`` picks (``padded`` runs the CPU twin of graphs)."""
        RetrievalOptions(cuda_graphs, precision, rescore)  # the options' own checks (UsageError)
        device_type = devices.kind(dev)
        if precision == "auto":
            precision = "fp16" if device_type == "cuda" else "fp32"
        mode = graphs or mode_for(dev, cuda_graphs)
        shapes = repo.section("shapes")
        cfg = artifacts.load_config(repo)
        spec = artifacts.load_spec(repo)
        if cfg.user_dense_dim != int(shapes.get("user_dense_dim", -1)):
            raise ArtifactMismatch(f"{repo.root / artifacts.TWO_TOWER_CONFIG_FILE}: user_dense_dim {cfg.user_dense_dim} "
                                   f"!= manifest shapes.user_dense_dim {shapes.get('user_dense_dim')}")
        if spec.num_items != int(shapes.get("num_items", -1)) or spec.dim != cfg.out_dim:
            raise ArtifactMismatch(f"{repo.root / artifacts.INDEX_SPEC_FILE}: index is {spec.num_items} x {spec.dim}, models "
                                   f"expect {shapes.get('num_items')} x {cfg.out_dim}")
        self.repo = repo
        self.model_version = repo.version
        self._dev = dev
        self._torch_device: torch.device | None = None
        self.device = devices.describe(dev)
        self.spec = spec
        self.num_items = spec.num_items
        self.user_dense_dim = cfg.user_dense_dim
        self.history_len = int(shapes.get("history_len", 0))
        self.user_table_sizes = np.asarray(cfg.user_table_sizes, dtype=np.int64)
        self._cfg = cfg
        self._torch_tower: Tower | None = None
        # the FAISS backend on the CPU runs the tower folded into numpy (same function, fewer dispatches),
        # read without torch; every other path runs the torch module
        self._folded = artifacts.load_folded_user_tower(repo, cfg) \
            if device_type == "cpu" and precision == "fp32" and mode == "eager" else None
        if self._folded is None:
            from recpipe.accel.transfer import DeviceIO

            self.io = DeviceIO(self.torch_device)
            self._tower = GraphRunner(self.tower, self.torch_device, mode)
        self.precision = precision
        self.index: Any = None
        self.exact: faiss_index.TorchExactSearch | None = None
        backend = "faiss-cpu"
        self.half_recall: float | None = None
        if precision != "fp32":
            emb = self.item_embeddings()
            self.exact = faiss_index.TorchExactSearch(emb, self.torch_device, precision, rescore)
            backend = f"torch-exact-{precision}" + (f"+fp32-rescore-x{rescore}" if rescore else "")
            self.half_recall = faiss_index.half_recall(emb, self.torch_device, precision, rescore)
            if self.half_recall < HALF_RECALL_TARGET:
                _log.warning("%s retrieval: recall@500 vs fp32 exact %.4f < %s; raise --rescore or use fp32",
                             precision, self.half_recall, HALF_RECALL_TARGET)
            del emb
        elif device_type == "cuda":
            gpu_faiss = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
            if gpu_faiss and spec.kind in ("flat", "ivf"):
                cpu_index = artifacts.load_index(repo, spec)
                self._gpu_res = faiss.StandardGpuResources()
                self.index = faiss.index_cpu_to_gpu(self._gpu_res, self.torch_device.index or 0, cpu_index)
                backend = "faiss-gpu"
            else:
                self.exact = faiss_index.TorchExactSearch(self.item_embeddings(), self.torch_device)
                backend = "torch-exact"
        else:
            self.index = artifacts.load_index(repo, spec)
        self.backend = backend
        self._details: dict[str, str] = {
            "index_type": spec.kind if self.exact is None else "flat (torch exact)",
            "trained_index_type": spec.kind,
            "nlist": str(spec.nlist),
            "nprobe": str(spec.nprobe),
            "max_nprobe": str(spec.max_nprobe),
            "ef_search": str(spec.ef_search),
            "max_ef_search": str(spec.max_ef_search),
            "k_factor": str(spec.k_factor),
            "recall_at_100": f"{spec.recall_at_100:.4f}",
            "recall_at_500": f"{spec.recall_at_500:.4f}",
            "backend": backend,
            "device": self.device,
            "precision": precision,
            "cuda_graphs": mode,
        }
        if self.half_recall is not None:
            # measured at load with 256 item vectors as the queries (no user features here)
            self._details[f"{precision}_recall_at_500_vs_fp32"] = f"{self.half_recall:.4f}"
            self._details[f"{precision}_recall_target"] = f"{HALF_RECALL_TARGET}"
        self._details["user_tower"] = "folded-numpy" if self._folded is not None else "torch"
        self._searches: dict[int, GraphRunner] = {}  # top-k bucket -> tower + exact search, one graph
        if mode == "graph":  # capture the single-query shapes now, not at the first request
            zeros = (np.zeros((1, self.user_dense_dim), np.float32), np.zeros((1, len(self.user_table_sizes)), np.int64))
            self.query_embeddings(*zeros)
            if self.exact is not None:
                self._exact_retrieve(*zeros, min(DEFAULT_NUM_CANDIDATES, self.num_items))
        self._fallback: faiss.Index | None = None

    @classmethod
    def load(cls, models_dir: Path, device: str = "auto", *, cuda_graphs: bool = True, precision: str = "auto",
             rescore: int = DEFAULT_RESCORE, graphs: str | None = None) -> RetrievalCore:
        """The core over ``models_dir``, warmed (``warm``): what a stage serves."""
        core = cls(Repository.open(Path(models_dir)), devices.resolve_name(device), cuda_graphs=cuda_graphs,
                   precision=precision, rescore=rescore, graphs=graphs)
        core.warm()
        return core

    def warm(self) -> None:
        """Search once for one query at the default k and at the largest, before the stage serves: a
        fresh stage's first query paid for the index's first touch, thread pools and kernels (5 ms
        against 0.6 ms for the second, scale 0.02). With CUDA graphs (and their CPU twin), every k
        bucket is captured for one query; other batch sizes are captured at their first use."""
        limits = self.limits
        ks = {min(DEFAULT_NUM_CANDIDATES, limits.max_k), limits.max_k}
        if self.exact is not None and self._tower.padded:
            ks |= {min(bucket(k, 16), limits.max_k) for k in (16 << i for i in range(limits.max_k.bit_length()))}
        dense, sparse = np.zeros(self.user_dense_dim, np.float32), np.zeros(len(self.user_table_sizes), np.int64)
        for k in sorted(ks):
            self.retrieve_batch([RetrieveQuery.checked(dense, sparse, k, limits)])

    @property
    def details(self) -> dict[str, str]:
        """For InfoService: the index and how it is searched, and what the core copied to and from
        its device so far (``recpipe.accel.traffic``; zeros where nothing crosses)."""
        return {**self._details, TRAFFIC_KEY: self.traffic.describe()}

    @property
    def traffic(self) -> Traffic:
        """The torch path's ``DeviceIO`` counters (none on the folded path: nothing is copied there)."""
        io = getattr(self, "io", None)
        return io.traffic if io is not None else Traffic()

    @property
    def torch_device(self) -> torch.device:
        """The core's device as a ``torch.device`` (imports torch)."""
        if self._torch_device is None:
            import torch

            self._torch_device = torch.device(str(self._dev))
        return self._torch_device

    @property
    def tower(self) -> Tower:
        """The user tower as a torch module on the core's device; where the core runs it folded, loaded
        (with torch) at the first use, by a bench or a test."""
        if self._torch_tower is None:
            self._torch_tower = artifacts.load_user_tower(self.repo, self._cfg).to(self.torch_device).eval()
        return self._torch_tower

    def item_embeddings(self) -> np.ndarray:
        """(num_items, D) float32 item embeddings from the repository (verified), read on demand."""
        return artifacts.load_embeddings(self.repo, self.spec)

    # ---- requests ----------------------------------------------------------------------------------

    @property
    def limits(self) -> RetrievalLimits:
        return RetrievalLimits(self.user_dense_dim, self.user_table_sizes, self.num_items)

    def query_embeddings(self, dense: np.ndarray, sparse: np.ndarray) -> torch.Tensor:
        """(B, Du) + (B, 44) -> (B, D) query vectors on the core's device (the batch padded to its bucket
        when the tower runs as a graph, or as the graph's CPU twin). A torch tensor: torch is imported on
        the folded path too (the served path, ``retrieve_batch``, calls the folded tower itself)."""
        import torch

        if self._folded is not None:
            return torch.from_numpy(self._folded(dense, sparse))
        b = dense.shape[0]
        rows = bucket(b) if self._tower.padded else b
        with torch.inference_mode(), self.io.stream():
            out = self._tower(self.io.put("dense", dense, np.float32, rows), self.io.put("sparse", sparse, np.int64, rows))
            # a graph's output is overwritten by its next replay: the caller gets its own copy
            if self._tower.mode == "graph":
                out = out[:b].clone()
            elif rows != b:
                out = out[:b]
        return self.io.hand_over(out)  # computed on the stage's stream, used on the caller's

    def retrieve(self, user: UserFeatures, k: int, nprobe: int = 0, ef_search: int = 0) -> Candidates:
        """The k best items for ``user`` (the arguments checked by ``RetrieveQuery``)."""
        query = RetrieveQuery.checked(user.dense, user.sparse, k, self.limits, nprobe, ef_search)
        return self.retrieve_batch([query])[0]

    def retrieve_batch(self, queries: Sequence[RetrieveQuery]) -> list[Candidates]:
        """One user-tower forward for all queries, then one index search per distinct (k, nprobe,
        ef_search) among them; each answer equals the one the query would get alone. With the torch
        exact search: tower and search in one call (one graph on CUDA) per distinct k."""
        dense = np.stack([q.dense for q in queries])
        sparse = np.stack([q.sparse for q in queries])
        if self.exact is not None:
            return self._exact_batch(queries, dense, sparse)
        # FAISS searches from host memory: one copy of the (B, D) query vectors, whatever the groups
        emb = self._folded(dense, sparse) if self._folded is not None else \
            self.query_embeddings(dense, sparse).float().cpu().numpy()
        if self._folded is None:  # the query vectors came back to the host for FAISS: this call's fetch
            self.io.traffic.add_call()
            if self.io.cuda:
                self.io.traffic.add_d2h(emb.nbytes)
        # An input that overflowed the tower gives a zero/NaN query: its scores are reported as NaN, which
        # the servicer answers as out of the model's range (recpipe.finite).
        bad = degenerate(np.linalg.norm(emb, axis=1))
        out: list[Candidates | None] = [None] * len(queries)
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, q in enumerate(queries):
            groups.setdefault(q.search_key, []).append(i)
        for (k, nprobe, ef_search), rows in groups.items():
            sel = emb if len(rows) == len(queries) else emb[rows]
            scores, ids = self._search(sel, k, nprobe, ef_search)
            if self.backend == "faiss-gpu":  # FAISS's own copies to its GPU index and back
                self.io.traffic.add_h2d(sel.nbytes)
                self.io.traffic.add_d2h(scores.nbytes + ids.nbytes, copies=2)
            for j, i in enumerate(rows):
                found = scores[j].astype(np.float32)
                if bad[i]:
                    found[:] = np.nan
                out[i] = Candidates(item_ids=ids[j].astype(np.int64), scores=found)
        return [c for c in out if c is not None]

    def _exact_batch(self, queries: Sequence[RetrieveQuery], dense: np.ndarray, sparse: np.ndarray) -> list[Candidates]:
        """The torch exact search ignores nprobe/efSearch: one tower + search call per distinct k."""
        out: list[Candidates | None] = [None] * len(queries)
        groups: dict[int, list[int]] = {}
        for i, q in enumerate(queries):
            groups.setdefault(q.k, []).append(i)
        for k, rows in groups.items():
            whole = len(rows) == len(queries)
            scores, ids = self._exact_retrieve(dense if whole else dense[rows], sparse if whole else sparse[rows], k)
            for j, i in enumerate(rows):
                out[i] = Candidates(item_ids=ids[j].astype(np.int64), scores=scores[j].astype(np.float32))
        return [c for c in out if c is not None]

    def _exact_retrieve(self, dense: np.ndarray, sparse: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, Du) + (B, 44) -> (B, k) scores, (B, k) ids: user tower, then the torch exact search.

        Padded (graph mode and its CPU twin): B up to its bucket, and k up to ``bucket(k, 16)``: the
        search keeps that many (sorted) and the first k are sliced off, so each k-bucket is one graph
        and a query's answer depends on its own k only, never on the batch it came in."""
        import torch

        assert self.exact is not None
        exact = self.exact
        b = dense.shape[0]
        padded = self._tower.padded
        rows = bucket(b) if padded else b
        kb = min(bucket(k, 16), self.num_items) if padded else k
        runner = self._searches.get(kb)
        if runner is None:
            tower = self.tower

            def tower_and_search(d: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return exact.search_tensors(tower(d, s), kb)

            runner = GraphRunner(tower_and_search, self.torch_device, self._tower.mode, share_pool_with=self._tower)
            self._searches[kb] = runner
        io = self.io
        with torch.inference_mode(), io.stream():
            scores, ids = runner(io.put("dense", dense, np.float32, rows), io.put("sparse", sparse, np.int64, rows))
            if kb != k:
                scores, ids = scores[:, :k], ids[:, :k]
            got_ids, got_scores = io.fetch_many([("ids", ids), ("scores", scores)], b)
        return got_scores, got_ids

    def _search(self, q: np.ndarray, k: int, nprobe: int, ef_search: int) -> tuple[np.ndarray, np.ndarray]:
        """FAISS top-k for the (B, D) queries; a row that comes back short is searched again alone,
        wider, exactly as it would have been without the others."""
        spec = self.spec
        probe = min(nprobe or spec.nprobe, spec.max_nprobe) if spec.kind in faiss_index.IVF_KINDS else 0
        ef = min(ef_search or spec.ef_search, spec.max_ef_search) if spec.kind == "hnsw" else 0
        faiss_index.set_search_params(self.index, spec, nprobe=probe, ef_search=ef, k=k)
        scores, ids = self.index.search(q, k)
        for row in np.flatnonzero(ids[:, -1] < 0):
            scores[row], ids[row] = self._widen(q[row : row + 1], k, probe, ef)
        return scores, ids

    def _widen(self, q: np.ndarray, k: int, probe: int, ef: int) -> tuple[np.ndarray, np.ndarray]:
        spec = self.spec
        while True:
            # Too few items in the probed lists / visited nodes for k results: widen the search.
            if spec.kind in faiss_index.IVF_KINDS and probe < spec.nlist:
                probe = min(spec.nlist, probe * 2)
            elif spec.kind == "hnsw" and ef < 4 * max(k, spec.ef_search):
                ef = 2 * max(ef, k)
            else:
                scores, ids = self._exact_fallback(q, k)
                return scores[0], ids[0]
            faiss_index.set_search_params(self.index, spec, nprobe=probe, ef_search=ef, k=k)
            scores, ids = self.index.search(q, k)
            if ids[0, -1] >= 0:
                return scores[0], ids[0]

    def _exact_fallback(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self._fallback is None:
            flat = faiss.IndexFlatIP(self.spec.dim)
            flat.add(self.item_embeddings())
            self._fallback = flat
        scores, ids = self._fallback.search(q, k)
        return scores, ids
