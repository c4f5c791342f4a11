"""The ranking core: DLRM click probabilities for one user's k candidate items."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from recpipe import device as devices
from recpipe.errors import ArtifactMismatch, BadRequest
from recpipe.finite import check_finite
from recpipe.ranking.files import DLRM_CONFIG_FILE, DLRM_FILE
from recpipe.ranking.model import DLRM, DLRMConfig
from recpipe.ranking.predictor import Predictor
from recpipe.repository import Repository
from recpipe.retrieval.core import check_user_features, load_state
from recpipe.types import ItemFeatures, UserFeatures


class RankingCore:
    """``rank(user, items)`` -> (k,) float32 click probabilities, in the order of ``items``."""

    def __init__(self, repo: Repository, dev: torch.device) -> None:
        shapes = repo.section("shapes")
        cfg = DLRMConfig.from_json(repo.json(DLRM_CONFIG_FILE), str(repo.root / DLRM_CONFIG_FILE))
        self.user_dense_dim = int(shapes.get("user_dense_dim", -1))
        self.item_dense_dim = int(shapes.get("item_dense_dim", -1))
        n_user_tables = int(shapes.get("user_sparse_dim", -1))
        if (cfg.user_dense_dim, cfg.item_dense_dim) != (self.user_dense_dim, self.item_dense_dim) or n_user_tables < 0 or \
                cfg.num_tables != n_user_tables + int(shapes.get("item_sparse_dim", -1)):
            raise ArtifactMismatch(
                f"{repo.root / DLRM_CONFIG_FILE}: DLRM expects {cfg.dense_dim} dense / {cfg.num_tables} sparse inputs, "
                f"manifest shapes give {self.user_dense_dim}+{self.item_dense_dim} / "
                f"{shapes.get('user_sparse_dim')}+{shapes.get('item_sparse_dim')}"
            )
        model = DLRM(cfg)
        load_state(repo.file(DLRM_FILE), model)
        self.model_version = repo.version
        self.torch_device = dev
        self.device = devices.describe(dev)
        self.config = cfg
        sizes = np.asarray(cfg.table_sizes, dtype=np.int64)
        self.user_table_sizes = sizes[:n_user_tables]
        self.item_table_sizes = sizes[n_user_tables:]
        self.predictor = Predictor(model, dev)
        self.predictor.set_user_tables(n_user_tables)

    @classmethod
    def load(cls, models_dir: Path, device: str = "auto") -> RankingCore:
        return cls(Repository.open(Path(models_dir)), devices.resolve(device))

    def rank(self, user: UserFeatures, items: ItemFeatures) -> np.ndarray:
        user_dense, user_sparse = check_user_features(user, self.user_dense_dim, self.user_table_sizes)
        dense = np.asarray(items.dense)
        sparse = np.asarray(items.sparse)
        if dense.ndim != 2 or dense.shape[1] != self.item_dense_dim:
            raise BadRequest(f"item dense features: expected shape [k, {self.item_dense_dim}], got {list(dense.shape)}")
        k = dense.shape[0]
        if sparse.shape != (k, self.item_table_sizes.shape[0]):
            raise BadRequest(f"item sparse features: expected shape [{k}, {self.item_table_sizes.shape[0]}], "
                             f"got {list(sparse.shape)}")
        if np.asarray(items.item_ids).shape != (k,):
            raise BadRequest(f"item_ids: expected shape [{k}], got {list(np.asarray(items.item_ids).shape)}")
        if dense.dtype.kind != "f" or not np.isfinite(dense).all():
            raise BadRequest("item dense features must be finite floats")
        if sparse.dtype.kind not in "iu" or (sparse < 0).any() or (sparse >= self.item_table_sizes).any():
            raise BadRequest("item sparse features: ids out of range for their tables")
        scores = self.predictor.score_candidates(user_dense, user_sparse, dense.astype(np.float32, copy=False),
                                                 sparse.astype(np.int64, copy=False))
        return check_finite(scores, "rank")
