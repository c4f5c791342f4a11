"""The retrieval stage's artifacts in the model repository: the two-tower model, the item embeddings,
the FAISS index and its tuned search parameters.

``save`` is what ``recpipe train`` calls; the loaders are what ``RetrievalCore`` calls. Weights and
embeddings are safetensors, configs JSON, the index FAISS's own format: nothing here unpickles. Only
``save`` and ``load_user_tower`` (the torch module) import torch: the folded user tower and the item
embeddings are read as numpy (``recpipe.safetensors_map``), so the CPU stage never loads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import faiss
import numpy as np

from recpipe.errors import ArtifactMismatch
from recpipe.repository import Repository, write_json
from recpipe.retrieval import index as faiss_index
from recpipe.retrieval.config import TwoTowerConfig
from recpipe.retrieval.folded import FoldedUserTower, user_tower_shapes
from recpipe.safetensors_map import map_safetensors

if TYPE_CHECKING:
    from recpipe.retrieval.model import Tower, TwoTower

TWO_TOWER_FILE = "retrieval/two_tower.safetensors"
TWO_TOWER_CONFIG_FILE = "retrieval/two_tower.json"
EMBEDDINGS_FILE = "retrieval/item_embeddings.safetensors"
INDEX_FILE = "retrieval/index.faiss"
INDEX_SPEC_FILE = "retrieval/index.json"
#: the user tower's tensors in ``TWO_TOWER_FILE`` carry this prefix (``TwoTower.user_tower``)
USER_TOWER_PREFIX = "user_tower."


def save(root: Path, model: TwoTower, item_embeddings: np.ndarray, index: faiss.Index,
         spec: faiss_index.IndexSpec, tried: Sequence[faiss_index.IndexSpec] = ()) -> None:
    """Write the model, the (num_items, D) float32 embeddings and the index under ``root``."""
    import torch
    from safetensors.torch import save_file

    from recpipe.nn import save_state

    (root / "retrieval").mkdir(exist_ok=True)
    save_state(root / TWO_TOWER_FILE, model)
    write_json(root / TWO_TOWER_CONFIG_FILE, model.config.to_json())
    save_file({"embeddings": torch.from_numpy(np.ascontiguousarray(item_embeddings))}, str(root / EMBEDDINGS_FILE))
    faiss_index.save(index, root / INDEX_FILE)
    write_json(root / INDEX_SPEC_FILE, {**spec.to_json(), "tried": [s.to_json() for s in tried]})


def load_config(repo: Repository) -> TwoTowerConfig:
    return TwoTowerConfig.from_json(repo.json(TWO_TOWER_CONFIG_FILE), str(repo.root / TWO_TOWER_CONFIG_FILE))


def load_spec(repo: Repository) -> faiss_index.IndexSpec:
    return faiss_index.IndexSpec.from_json(repo.json(INDEX_SPEC_FILE), str(repo.root / INDEX_SPEC_FILE))


def load_user_tower(repo: Repository, cfg: TwoTowerConfig) -> Tower:
    """The trained user tower on the CPU, as a torch module."""
    from recpipe.nn import load_state
    from recpipe.retrieval.model import Tower

    tower = Tower(cfg.user_dense_dim, cfg.user_table_sizes, cfg.embedding_dim, cfg.hidden_dims, cfg.out_dim)
    load_state(repo.file(TWO_TOWER_FILE), tower, USER_TOWER_PREFIX)
    return tower


def load_folded_user_tower(repo: Repository, cfg: TwoTowerConfig) -> FoldedUserTower:
    """The trained user tower folded into numpy (``Tower.folded()`` of ``load_user_tower``, bit for bit),
    read without torch; weights that do not match ``cfg`` are an ``ArtifactMismatch`` naming the file."""
    path = repo.file(TWO_TOWER_FILE)
    arrays, _ = map_safetensors(path)
    state = {k[len(USER_TOWER_PREFIX) :]: v for k, v in arrays.items() if k.startswith(USER_TOWER_PREFIX)}
    want = user_tower_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != want:
        wrong = [f"missing {k}" for k in sorted(set(want) - set(got))]
        wrong += [f"unexpected {k}" for k in sorted(set(got) - set(want))]
        wrong += [f"{k} is {list(got[k])}, expected {list(want[k])}" for k in sorted(set(got) & set(want))
                  if got[k] != want[k]]
        raise ArtifactMismatch(f"{path}: weights do not match the model config ({'; '.join(wrong[:3])})")
    # copied out of the mapping: aligned, writable float32 arrays, as safetensors' own loader gives
    return FoldedUserTower.from_state({k: np.array(v, dtype=np.float32) for k, v in state.items()}, cfg)


def load_index(repo: Repository, spec: faiss_index.IndexSpec) -> faiss.Index:
    return faiss_index.load(repo.file(INDEX_FILE), spec)


def load_embeddings(repo: Repository, spec: faiss_index.IndexSpec) -> np.ndarray:
    """(num_items, D) float32 item embeddings (verified against the index spec), a copy in memory."""
    path = repo.file(EMBEDDINGS_FILE)
    arrays, _ = map_safetensors(path)
    if "embeddings" not in arrays:
        raise ArtifactMismatch(f"{path}: unreadable item embeddings (no 'embeddings' tensor)")
    emb = np.array(arrays["embeddings"], dtype=np.float32)
    if emb.shape != (spec.num_items, spec.dim):
        raise ArtifactMismatch(f"{path}: embeddings are {list(emb.shape)}, index.json says [{spec.num_items}, {spec.dim}]")
    return emb
