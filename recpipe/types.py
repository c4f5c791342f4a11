"""The arrays that flow between stages, with their shapes and dtypes.

These are what the pure cores take and return (no gRPC here); ``recpipe.codec`` moves them across the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
