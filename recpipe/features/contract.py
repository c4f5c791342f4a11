"""The feature stage's requests, validated once: ``UserQuery.checked`` and ``ItemsQuery.checked`` are the
only places their fields are checked, whether a request came over gRPC (``servicer.py`` decodes the
tensor with ``recpipe.serving.codec`` first) or from an in-process caller. ``FeatureCore`` trusts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recpipe.config import MAX_NUM_CANDIDATES
from recpipe.errors import BadRequest, UnknownUser


@dataclass(frozen=True)
class FeatureLimits:
    num_users: int
    num_items: int


@dataclass(frozen=True)
class UserQuery:
    """A known user: 0 <= user_id < num_users."""

    user_id: int

    @classmethod
    def checked(cls, user_id: object, limits: FeatureLimits) -> UserQuery:
        if isinstance(user_id, bool) or not isinstance(user_id, int | np.integer):
            raise BadRequest(f"user_id must be an integer, got {type(user_id).__name__}")
        uid = int(user_id)
        if not 0 <= uid < limits.num_users:
            raise UnknownUser(f"unknown user {uid} (valid ids are 0..{limits.num_users - 1})")
        return cls(uid)


@dataclass(frozen=True)
class ItemsQuery:
    """A known user and item_ids (k,) int64, each in 0..num_items-1, 1 <= k <= 10,000."""

    user_id: int
    item_ids: np.ndarray

    @classmethod
    def checked(cls, user_id: object, item_ids: np.ndarray, limits: FeatureLimits) -> ItemsQuery:
        uid = UserQuery.checked(user_id, limits).user_id
        arr = np.asarray(item_ids)
        if arr.ndim != 1:
            raise BadRequest(f"item_ids must be 1-D, got shape {list(arr.shape)}")
        if arr.dtype.kind not in "iu":
            raise BadRequest(f"item_ids must be integers, got {arr.dtype}")
        if not 0 < arr.shape[0] <= MAX_NUM_CANDIDATES:
            raise BadRequest(f"item_ids: expected 1..{MAX_NUM_CANDIDATES} ids, got {arr.shape[0]}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limits.num_items):
            bad = int(arr[(arr < 0) | (arr >= limits.num_items)][0])
            raise BadRequest(f"item_ids: item id {bad} out of range (valid ids are 0..{limits.num_items - 1})")
        return cls(uid, arr.astype(np.int64, copy=False))
