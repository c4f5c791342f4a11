"""The retrieval core: user tower forward + top-k search over the item index.

Backends: the FAISS index on CPU; on a CUDA device the same index moved to the GPU when the
installed faiss has GPU support (flat, IVF), otherwise exact search with torch (matmul + topk) over
the item embeddings on the GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from safetensors.torch import load_file

from recpipe import device as devices
from recpipe.config import MAX_NUM_CANDIDATES
from recpipe.errors import ArtifactMismatch, BadRequest
from recpipe.finite import check_unit_norm
from recpipe.repository import Repository
from recpipe.retrieval import index as faiss_index
from recpipe.retrieval.files import (
    EMBEDDINGS_FILE,
    INDEX_FILE,
    INDEX_SPEC_FILE,
    TWO_TOWER_CONFIG_FILE,
    TWO_TOWER_FILE,
)
from recpipe.retrieval.model import Tower, TwoTowerConfig
from recpipe.types import Candidates, UserFeatures


def load_state(path: Path, module: torch.nn.Module, prefix: str = "") -> None:
    """Load ``prefix``-ed tensors of a safetensors file into ``module``; any mismatch names the file."""
    try:
        state = load_file(str(path))
    except Exception as e:
        raise ArtifactMismatch(f"{path}: unreadable safetensors ({e})") from None
    if prefix:
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0:3]
        raise ArtifactMismatch(f"{path}: weights do not match the model config ({' '.join(first)})") from None


def check_user_features(user: UserFeatures, dense_dim: int, table_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validated (dense (Du,) float32, sparse (44,) int64) or ``BadRequest``."""
    dense = np.asarray(user.dense)
    sparse = np.asarray(user.sparse)
    if dense.shape != (dense_dim,):
        raise BadRequest(f"user dense features: expected shape [{dense_dim}], got {list(dense.shape)}")
    if dense.dtype.kind != "f" or not np.isfinite(dense).all():
        raise BadRequest("user dense features must be finite floats")
    if sparse.shape != table_sizes.shape:
        raise BadRequest(f"user sparse features: expected shape [{table_sizes.shape[0]}], got {list(sparse.shape)}")
    if sparse.dtype.kind not in "iu" or (sparse < 0).any() or (sparse >= table_sizes).any():
        raise BadRequest("user sparse features: ids out of range for their tables")
    return dense.astype(np.float32, copy=False), sparse.astype(np.int64, copy=False)


class RetrievalCore:
    """``retrieve(user, k)`` -> the k best item ids for the user, scores descending."""

    def __init__(self, repo: Repository, dev: torch.device) -> None:
        shapes = repo.section("shapes")
        cfg = TwoTowerConfig.from_json(repo.json(TWO_TOWER_CONFIG_FILE), str(repo.root / TWO_TOWER_CONFIG_FILE))
        spec = faiss_index.IndexSpec.from_json(repo.json(INDEX_SPEC_FILE), str(repo.root / INDEX_SPEC_FILE))
        if cfg.user_dense_dim != int(shapes.get("user_dense_dim", -1)):
            raise ArtifactMismatch(f"{repo.root / TWO_TOWER_CONFIG_FILE}: user_dense_dim {cfg.user_dense_dim} "
                                   f"!= manifest shapes.user_dense_dim {shapes.get('user_dense_dim')}")
        if spec.num_items != int(shapes.get("num_items", -1)) or spec.dim != cfg.out_dim:
            raise ArtifactMismatch(f"{repo.root / INDEX_SPEC_FILE}: index is {spec.num_items} x {spec.dim}, models "
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
        self.tower = Tower(cfg.user_dense_dim, cfg.user_table_sizes, cfg.embedding_dim, cfg.hidden_dims, cfg.out_dim)
        load_state(repo.file(TWO_TOWER_FILE), self.tower, "user_tower.")
        self.tower = self.tower.to(dev).eval()
        self.index: Any = None
        self.exact: faiss_index.TorchExactSearch | None = None
        backend = "faiss-cpu"
        if dev.type == "cuda":
            gpu_faiss = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
            if gpu_faiss and spec.kind in ("flat", "ivf"):
                cpu_index = faiss_index.load(repo.file(INDEX_FILE), spec)
                self._gpu_res = faiss.StandardGpuResources()
                self.index = faiss.index_cpu_to_gpu(self._gpu_res, dev.index or 0, cpu_index)
                backend = "faiss-gpu"
            else:
                self.exact = faiss_index.TorchExactSearch(self.item_embeddings(), dev)
                backend = "torch-exact"
        else:
            self.index = faiss_index.load(repo.file(INDEX_FILE), spec)
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
        path = self.repo.file(EMBEDDINGS_FILE)
        try:
            emb = load_file(str(path))["embeddings"].numpy()
        except Exception as e:
            raise ArtifactMismatch(f"{path}: unreadable item embeddings ({e})") from None
        if emb.shape != (self.spec.num_items, self.spec.dim):
            raise ArtifactMismatch(f"{path}: embeddings are {list(emb.shape)}, index.json says "
                                   f"[{self.spec.num_items}, {self.spec.dim}]")
        return emb

    # ---- requests ----------------------------------------------------------------------------------

    def check_k(self, k: int) -> int:
        if isinstance(k, bool) or not isinstance(k, int | np.integer):
            raise BadRequest(f"k must be an integer, got {type(k).__name__}")
        limit = min(self.num_items, MAX_NUM_CANDIDATES)
        if not 1 <= int(k) <= limit:
            raise BadRequest(f"k must be in 1..{limit}, got {int(k)}")
        return int(k)

    def query_embeddings(self, dense: np.ndarray, sparse: np.ndarray) -> torch.Tensor:
        """(B, Du) + (B, 44) -> (B, D) query vectors on the core's device."""
        with torch.inference_mode():
            d = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).to(self.torch_device)
            s = torch.from_numpy(np.ascontiguousarray(sparse, dtype=np.int64)).to(self.torch_device)
            return self.tower(d, s)

    def retrieve(self, user: UserFeatures, k: int, nprobe: int = 0, ef_search: int = 0) -> Candidates:
        k = self.check_k(k)
        for name, value in (("nprobe", nprobe), ("ef_search", ef_search)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise BadRequest(f"{name} must be a non-negative integer, got {value!r}")
        dense, sparse = check_user_features(user, self.user_dense_dim, self.user_table_sizes)
        query = self.query_embeddings(dense[None, :], sparse[None, :])
        check_unit_norm(torch.linalg.vector_norm(query.float(), dim=-1).cpu().numpy(), "retrieve")
        if self.exact is not None:
            scores, ids = self.exact.search(query, k)
            return Candidates(item_ids=ids[0].astype(np.int64), scores=scores[0].astype(np.float32))
        q = query.float().cpu().numpy()
        spec = self.spec
        probe = min(int(nprobe) or spec.nprobe, spec.max_nprobe) if spec.kind == "ivf" else 0
        ef = min(int(ef_search) or spec.ef_search, spec.max_ef_search) if spec.kind == "hnsw" else 0
        while True:
            faiss_index.set_search_params(self.index, spec, nprobe=probe, ef_search=ef, k=k)
            scores, ids = self.index.search(q, k)
            if ids[0, -1] >= 0:
                break
            # Too few items in the probed lists / visited nodes for k results: widen the search.
            if spec.kind == "ivf" and probe < spec.nlist:
                probe = min(spec.nlist, probe * 2)
            elif spec.kind == "hnsw" and ef < 4 * max(k, spec.ef_search):
                ef = 2 * max(ef, k)
            else:
                scores, ids = self._exact_fallback(q, k)
                break
        return Candidates(item_ids=ids[0].astype(np.int64), scores=scores[0].astype(np.float32))

    def _exact_fallback(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self._fallback is None:
            flat = faiss.IndexFlatIP(self.spec.dim)
            flat.add(self.item_embeddings())
            self._fallback = flat
        scores, ids = self._fallback.search(q, k)
        return scores, ids
