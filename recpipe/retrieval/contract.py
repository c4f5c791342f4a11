"""The retrieval stage's request, validated once: ``RetrieveQuery.checked`` is the only place its fields
are checked, whether the query came over gRPC (``servicer.py`` decodes the tensors with ``recpipe.serving.codec``
first) or from an in-process caller. ``RetrievalCore`` trusts a ``RetrieveQuery``.

The stage owns the bound on ``k``: 0 means the default (500, or the whole catalogue when it is smaller),
and anything above the catalogue is refused naming the item count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recpipe.config import DEFAULT_NUM_CANDIDATES, MAX_NUM_CANDIDATES
from recpipe.errors import BadRequest
from recpipe.types import check_user_arrays

#: Per-request ceilings on the search effort a caller may ask for (0 = the index's tuned default).
MAX_NPROBE = 4096
MAX_EF_SEARCH = 16384


@dataclass(frozen=True)
class RetrievalLimits:
    """What a query is checked against: the loaded model's input sizes and the catalogue size."""

    user_dense_dim: int
    user_table_sizes: np.ndarray  # (44,) int64 rows per user table
    num_items: int

    @property
    def max_k(self) -> int:
        return min(MAX_NUM_CANDIDATES, self.num_items)


@dataclass(frozen=True)
class RetrieveQuery:
    """dense (Du,) float32 finite, sparse (44,) int64 in range, k in 1..max_k, nprobe/ef_search >= 0
    (0 = the tuned default; larger values are capped by the index)."""

    dense: np.ndarray
    sparse: np.ndarray
    k: int
    nprobe: int = 0
    ef_search: int = 0

    @classmethod
    def checked(
        cls, dense: np.ndarray, sparse: np.ndarray, k: int, limits: RetrievalLimits, nprobe: int = 0,
        ef_search: int = 0,
    ) -> RetrieveQuery:
        k = _integer("k", k)
        if k < 0:
            raise BadRequest(f"k must be >= 0 (0 = default), got {k}")
        if k > MAX_NUM_CANDIDATES:
            raise BadRequest(f"k must be <= {MAX_NUM_CANDIDATES}, got {k}")
        if k > limits.num_items:
            raise BadRequest(f"k must be <= the item count {limits.num_items}, got {k}")
        k = k or min(DEFAULT_NUM_CANDIDATES, limits.num_items)
        nprobe = _integer("nprobe", nprobe)
        ef_search = _integer("ef_search", ef_search)
        if not 0 <= nprobe <= MAX_NPROBE:
            raise BadRequest(f"nprobe must be in 0..{MAX_NPROBE}, got {nprobe}")
        if not 0 <= ef_search <= MAX_EF_SEARCH:
            raise BadRequest(f"ef_search must be in 0..{MAX_EF_SEARCH}, got {ef_search}")
        d, s = check_user_arrays(dense, sparse, limits.user_dense_dim, limits.user_table_sizes)
        return cls(d, s, k, nprobe, ef_search)

    @property
    def search_key(self) -> tuple[int, int, int]:
        """Queries with the same key can share one index search."""
        return (self.k, self.nprobe, self.ef_search)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise BadRequest(f"{name} must be an integer, got {type(value).__name__}")
    return int(value)
