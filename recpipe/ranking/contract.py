"""The ranking stage's request, validated once: ``RankQuery.checked`` is the only place its fields are
checked, whether the query came over gRPC (``servicer.py`` decodes the tensors with ``recpipe.serving.codec``
first) or from an in-process caller. ``RankingCore`` trusts a ``RankQuery``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recpipe.config import MAX_NUM_CANDIDATES
from recpipe.errors import BadRequest
from recpipe.types import check_user_arrays


@dataclass(frozen=True)
class RankingLimits:
    """The loaded DLRM's input sizes."""

    user_dense_dim: int
    item_dense_dim: int
    user_table_sizes: np.ndarray  # (44,) int64
    item_table_sizes: np.ndarray  # (16,) int64


@dataclass(frozen=True)
class RankQuery:
    """One user and k candidates: user_dense (Du,) float32, user_sparse (44,) int64, item_dense (k, Di)
    float32, item_sparse (k, 16) int64; floats finite, ids within their tables, k in 1..10,000."""

    user_dense: np.ndarray
    user_sparse: np.ndarray
    item_dense: np.ndarray
    item_sparse: np.ndarray

    @property
    def k(self) -> int:
        return int(self.item_dense.shape[0])

    @classmethod
    def checked(
        cls, user_dense: np.ndarray, user_sparse: np.ndarray, item_dense: np.ndarray, item_sparse: np.ndarray,
        limits: RankingLimits,
    ) -> RankQuery:
        ud, us = check_user_arrays(user_dense, user_sparse, limits.user_dense_dim, limits.user_table_sizes)
        dense = np.asarray(item_dense)
        sparse = np.asarray(item_sparse)
        if dense.ndim != 2 or dense.shape[1] != limits.item_dense_dim:
            raise BadRequest(f"item dense features: expected shape [k, {limits.item_dense_dim}], "
                             f"got {list(dense.shape)}")
        k = dense.shape[0]
        if not 0 < k <= MAX_NUM_CANDIDATES:
            raise BadRequest(f"item_dense: expected 1..{MAX_NUM_CANDIDATES} rows, got {k}")
        if sparse.shape != (k, limits.item_table_sizes.shape[0]):
            raise BadRequest(f"item sparse features: expected shape [{k}, {limits.item_table_sizes.shape[0]}], "
                             f"got {list(sparse.shape)}")
        if dense.dtype.kind != "f" or not np.isfinite(dense).all():
            raise BadRequest("item dense features must be finite floats")
        if sparse.dtype.kind not in "iu" or (sparse < 0).any() or (sparse >= limits.item_table_sizes).any():
            raise BadRequest("item sparse features: ids out of range for their tables")
        return cls(ud, us, dense.astype(np.float32, copy=False), sparse.astype(np.int64, copy=False))
