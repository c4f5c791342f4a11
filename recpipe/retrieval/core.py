"""The retrieval core: user tower forward + top-k search over the item index.

Backends: the FAISS index on CPU; on a CUDA device the same index moved to the GPU when the
installed faiss has GPU support (flat, IVF), otherwise exact search with torch (matmul + topk) over
the item embeddings on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from recpipe import device as devices
from recpipe.errors import ArtifactMismatch
from recpipe.finite import degenerate
from recpipe.repository import Repository
from recpipe.retrieval import artifacts
from recpipe.retrieval import index as faiss_index
from recpipe.retrieval.contract import RetrievalLimits, RetrieveQuery
from recpipe.types import Candidates, UserFeatures


class RetrievalCore:
    """``retrieve(user, k)`` -> the k best item ids for the user, scores descending."""

    def __init__(self, repo: Repository, dev: torch.device) -> None:
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
        self.torch_device = dev
        self.device = devices.describe(dev)
        self.spec = spec
        self.num_items = spec.num_items
        self.user_dense_dim = cfg.user_dense_dim
        self.history_len = int(shapes.get("history_len", 0))
        self.user_table_sizes = np.asarray(cfg.user_table_sizes, dtype=np.int64)
        self.tower = artifacts.load_user_tower(repo, cfg).to(dev).eval()
        self.index: Any = None
        self.exact: faiss_index.TorchExactSearch | None = None
        backend = "faiss-cpu"
        if dev.type == "cuda":
            gpu_faiss = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
            if gpu_faiss and spec.kind in ("flat", "ivf"):
                cpu_index = artifacts.load_index(repo, spec)
                self._gpu_res = faiss.StandardGpuResources()
                self.index = faiss.index_cpu_to_gpu(self._gpu_res, dev.index or 0, cpu_index)
                backend = "faiss-gpu"
            else:
                self.exact = faiss_index.TorchExactSearch(self.item_embeddings(), dev)
                backend = "torch-exact"
        else:
            self.index = artifacts.load_index(repo, spec)
        self.backend = backend
        self.details: dict[str, str] = {
            "index_type": spec.kind if self.exact is None else "flat (torch exact)",
            "trained_index_type": spec.kind,
            "nlist": str(spec.nlist),
            "nprobe": str(spec.nprobe),
            "max_nprobe": str(spec.max_nprobe),
            "ef_search": str(spec.ef_search),
            "max_ef_search": str(spec.max_ef_search),
            "recall_at_100": f"{spec.recall_at_100:.4f}",
            "backend": backend,
            "device": self.device,
        }
        self._fallback: faiss.Index | None = None

    @classmethod
    def load(cls, models_dir: Path, device: str = "auto") -> RetrievalCore:
        return cls(Repository.open(Path(models_dir)), devices.resolve(device))

    def item_embeddings(self) -> np.ndarray:
        """(num_items, D) float32 item embeddings from the repository (verified), read on demand."""
        return artifacts.load_embeddings(self.repo, self.spec)

    # ---- requests ----------------------------------------------------------------------------------

    @property
    def limits(self) -> RetrievalLimits:
        return RetrievalLimits(self.user_dense_dim, self.user_table_sizes, self.num_items)

    def query_embeddings(self, dense: np.ndarray, sparse: np.ndarray) -> torch.Tensor:
        """(B, Du) + (B, 44) -> (B, D) query vectors on the core's device."""
        with torch.inference_mode():
            d = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).to(self.torch_device)
            s = torch.from_numpy(np.ascontiguousarray(sparse, dtype=np.int64)).to(self.torch_device)
            return self.tower(d, s)

    def retrieve(self, user: UserFeatures, k: int, nprobe: int = 0, ef_search: int = 0) -> Candidates:
        """The k best items for ``user`` (the arguments checked by ``RetrieveQuery``)."""
        query = RetrieveQuery.checked(user.dense, user.sparse, k, self.limits, nprobe, ef_search)
        return self.retrieve_batch([query])[0]

    def retrieve_batch(self, queries: Sequence[RetrieveQuery]) -> list[Candidates]:
        """One user-tower forward for all queries, then one index search per distinct (k, nprobe,
        ef_search) among them; each answer equals the one the query would get alone."""
        dense = np.stack([q.dense for q in queries])
        sparse = np.stack([q.sparse for q in queries])
        emb = self.query_embeddings(dense, sparse)
        # An input that overflowed the tower gives a zero/NaN query: its scores are reported as NaN, which
        # the servicer answers as out of the model's range (recpipe.finite).
        bad = degenerate(torch.linalg.vector_norm(emb.float(), dim=-1).cpu().numpy())
        out: list[Candidates | None] = [None] * len(queries)
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, q in enumerate(queries):
            groups.setdefault(q.search_key, []).append(i)
        for (k, nprobe, ef_search), rows in groups.items():
            sel = emb if len(rows) == len(queries) else emb[torch.as_tensor(rows, device=emb.device)]
            if self.exact is not None:
                scores, ids = self.exact.search(sel, k)
            else:
                scores, ids = self._search(sel.float().cpu().numpy(), k, nprobe, ef_search)
            for j, i in enumerate(rows):
                found = scores[j].astype(np.float32)
                if bad[i]:
                    found[:] = np.nan
                out[i] = Candidates(item_ids=ids[j].astype(np.int64), scores=found)
        return [c for c in out if c is not None]

    def _search(self, q: np.ndarray, k: int, nprobe: int, ef_search: int) -> tuple[np.ndarray, np.ndarray]:
        """FAISS top-k for the (B, D) queries; a row that comes back short is searched again alone,
        wider, exactly as it would have been without the others."""
        spec = self.spec
        probe = min(nprobe or spec.nprobe, spec.max_nprobe) if spec.kind == "ivf" else 0
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
            if spec.kind == "ivf" and probe < spec.nlist:
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
