"""The arrays that flow between stages, with their shapes and dtypes.

These are what the pure cores take and return (no gRPC here); ``recpipe.serving.codec`` moves them across the wire.
``check_user_arrays`` is the one check of a user's feature arrays, shared by the retrieval and ranking
contracts (both take the user features the feature stage produced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from recpipe.errors import BadRequest

T = TypeVar("T", covariant=True)


@dataclass(frozen=True)
class UserFeatures:
    """One user's encoded features, as returned by ``FeatureCore.augment_user``.

    dense: (Du,) float32, sparse: (44,) int64 per-table local ids, recent_items: (H,) int64, -1 padded.
    """

    user_id: int
    dense: np.ndarray
    sparse: np.ndarray
    recent_items: np.ndarray


@dataclass(frozen=True)
class ItemFeatures:
    """k candidate items' encoded features for one user, as returned by ``FeatureCore.augment_items``.

    dense: (k, Di) float32 (item continuous + user x item cross features), sparse: (k, 16) int64.
    """

    item_ids: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray


@dataclass(frozen=True)
class Candidates:
    """Retrieval output: item_ids (k,) int64 distinct, scores (k,) float32 descending."""

    item_ids: np.ndarray
    scores: np.ndarray


@dataclass(frozen=True)
class StageResult(Generic[T]):
    """A stage's answer with the time the stage spent on it and the model version it used.

    ``queue_us``/``compute_us``/``batch_size``: the part of ``server_us`` spent queued in the stage's
    batcher, the core call it ran in, and how many requests shared that call.
    """

    value: T
    server_us: int
    model_version: str = ""
    queue_us: int = 0
    compute_us: int = 0
    batch_size: int = 0

    def timing(self, stage: str, observed_us: int) -> StageTiming:
        return StageTiming(stage, self.server_us, observed_us, self.queue_us, self.compute_us, self.batch_size)


@dataclass(frozen=True)
class StageTiming:
    """Per stage: server_us inside the stage, observed_us seen by the gateway, and the stage's split of
    server_us into queue_us (batcher queue) and compute_us (core call of batch_size requests)."""

    stage: str
    server_us: int
    observed_us: int
    queue_us: int = 0
    compute_us: int = 0
    batch_size: int = 0


@dataclass(frozen=True)
class Recommendation:
    """item_ids (n,) int64 distinct, scores (n,) float32 descending, one timing per stage + total."""

    item_ids: np.ndarray
    scores: np.ndarray
    timings: tuple[StageTiming, ...]
    model_version: str

    def timing(self, stage: str) -> StageTiming:
        for t in self.timings:
            if t.stage == stage:
                return t
        raise KeyError(stage)


def check_user_arrays(
    dense: np.ndarray, sparse: np.ndarray, dense_dim: int, table_sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Validated (dense (Du,) float32 finite, sparse (T,) int64 within each table) or ``BadRequest``."""
    dense = np.asarray(dense)
    sparse = np.asarray(sparse)
    if dense.shape != (dense_dim,):
        raise BadRequest(f"user dense features: expected shape [{dense_dim}], got {list(dense.shape)}")
    if dense.dtype.kind != "f" or not np.isfinite(dense).all():
        raise BadRequest("user dense features must be finite floats")
    if sparse.shape != table_sizes.shape:
        raise BadRequest(f"user sparse features: expected shape [{table_sizes.shape[0]}], got {list(sparse.shape)}")
    if sparse.dtype.kind not in "iu" or (sparse < 0).any() or (sparse >= table_sizes).any():
        raise BadRequest("user sparse features: ids out of range for their tables")
    return dense.astype(np.float32, copy=False), sparse.astype(np.int64, copy=False)
