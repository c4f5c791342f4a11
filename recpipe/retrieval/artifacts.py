"""The retrieval stage's artifacts in the model repository: the two-tower model, the item embeddings,
the FAISS index and its tuned search parameters.

``save`` is what ``recpipe train`` calls; the loaders are what ``RetrievalCore`` calls. Weights and
embeddings are safetensors, configs JSON, the index FAISS's own format: nothing here unpickles.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import faiss
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from recpipe.errors import ArtifactMismatch
from recpipe.nn import load_state, save_state
from recpipe.repository import Repository, write_json
from recpipe.retrieval import index as faiss_index
from recpipe.retrieval.model import Tower, TwoTower, TwoTowerConfig

TWO_TOWER_FILE = "retrieval/two_tower.safetensors"
TWO_TOWER_CONFIG_FILE = "retrieval/two_tower.json"
EMBEDDINGS_FILE = "retrieval/item_embeddings.safetensors"
INDEX_FILE = "retrieval/index.faiss"
INDEX_SPEC_FILE = "retrieval/index.json"


def save(root: Path, model: TwoTower, item_embeddings: np.ndarray, index: faiss.Index,
         spec: faiss_index.IndexSpec, tried: Sequence[faiss_index.IndexSpec] = ()) -> None:
    """Write the model, the (num_items, D) float32 embeddings and the index under ``root``."""
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
    """The trained user tower on the CPU."""
    tower = Tower(cfg.user_dense_dim, cfg.user_table_sizes, cfg.embedding_dim, cfg.hidden_dims, cfg.out_dim)
    load_state(repo.file(TWO_TOWER_FILE), tower, "user_tower.")
    return tower


def load_index(repo: Repository, spec: faiss_index.IndexSpec) -> faiss.Index:
    return faiss_index.load(repo.file(INDEX_FILE), spec)


def load_embeddings(repo: Repository, spec: faiss_index.IndexSpec) -> np.ndarray:
    """(num_items, D) float32 item embeddings (verified against the index spec)."""
    path = repo.file(EMBEDDINGS_FILE)
    try:
        emb = load_file(str(path))["embeddings"].numpy()
    except Exception as e:
        raise ArtifactMismatch(f"{path}: unreadable item embeddings ({e})") from None
    if emb.shape != (spec.num_items, spec.dim):
        raise ArtifactMismatch(f"{path}: embeddings are {list(emb.shape)}, index.json says [{spec.num_items}, {spec.dim}]")
    return emb
