"""How the DLRM's embedding tables start and which of them learn (issue 23).

Two treatments, both decided from the training split alone and invisible to serving (the model keeps
its shape; only the weights differ):

- **Tables too sparse to learn stay at zero.** A table with fewer than ``min_rows_per_id`` training
  rows per embedding row (an epoch's rows over its vocabulary size) sees each id a handful of times: it
  can only memorise those rows' labels. Such tables start at zero (and, when the tables learn, their
  gradient is masked), so every pairwise dot they take part in is 0 and the top MLP gets no noise
  from them. On the scale-0.1 data this kept held-out AUC rising for 4 epochs instead of 2
  (BENCHMARKS.md, issue 23).
- **The leaf-category table starts from exposure.** Who is shown a category says what its items are
  like: the mean encoded continuous row of the users each leaf category was shown to in the training
  split (impressions, not clicks: no label is read), reduced by a weighted PCA to the embedding
  width, is that table's initial value. Its dot with the user's bottom-MLP vector then only has to
  learn a linear map, where a random start would have to learn 1000 vectors (and by default the
  tables keep their start: ``TrainConfig.ranking_embedding_lr``, ``fixed_tables``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from recpipe.features.core import FeatureCore

#: the table initialised from exposure: the item's leaf category (it keys the cross features too)
EXPOSURE_COLUMN = "i_cat_00"
#: root-mean-square of an exposure-initialised entry (the random start is 0.05)
EXPOSURE_RMS = 1.0


def sparse_tables(table_sizes: Sequence[int], rows_per_epoch: int, min_rows_per_id: float) -> list[int]:
    """Indices of the tables with fewer than ``min_rows_per_id`` training rows per embedding row."""
    if min_rows_per_id <= 0:
        return []
    return [t for t, size in enumerate(table_sizes) if rows_per_epoch / size < min_rows_per_id]


def row_mask(table_sizes: Sequence[int], frozen: Sequence[int]) -> torch.Tensor:
    """(sum(sizes), 1) float: 0 on the rows of ``frozen`` tables, 1 elsewhere."""
    zeroed = set(frozen)
    parts = [torch.full((size, 1), 0.0 if t in zeroed else 1.0) for t, size in enumerate(table_sizes)]
    return torch.cat(parts)


def zero_rows(weight: torch.nn.Parameter, mask: torch.Tensor, keep: bool = True) -> torch.utils.hooks.RemovableHandle | None:
    """Zero the masked rows of the fused table. With ``keep``, keep them there while the table learns:
    their gradient is masked too, so Adam's moments for them stay 0 and its step is 0; returns the
    hook's handle (None without ``keep``: a table that takes no gradient needs no hook)."""
    mask = mask.to(weight.device, weight.dtype)
    with torch.no_grad():
        weight.mul_(mask)
    return weight.register_hook(lambda grad: grad * mask) if keep else None


def exposure_vectors(user_rows: np.ndarray, users: np.ndarray, shown: np.ndarray, size: int, dim: int) -> np.ndarray:
    """(size, dim) float32: row j from the mean user row over the impressions of id j.

    ``user_rows`` (num_users, C) are the users' encoded continuous rows; impression k showed an item
    with the table's local id ``shown[k]`` to user ``users[k]``. The per-id means are centred, reduced
    to ``dim`` components by a PCA weighted by impressions, and scaled to ``EXPOSURE_RMS``; ids never
    shown, and id 0 (null / unseen), get zeros.
    """
    counts = np.bincount(shown, minlength=size).astype(np.float64)[:size]
    sums = np.stack([np.bincount(shown, weights=user_rows[users, c], minlength=size)[:size]
                     for c in range(user_rows.shape[1])], axis=1)
    counts[0] = 0.0
    seen = counts > 0
    out = np.zeros((size, dim), np.float32)
    if seen.sum() < 2:
        return out
    means = sums[seen] / counts[seen, None]
    w = counts[seen] / counts[seen].sum()
    centred = means - w @ means
    cov = (centred * w[:, None]).T @ centred
    _, vectors = np.linalg.eigh(cov)
    k = min(dim, vectors.shape[1])
    proj = centred @ vectors[:, ::-1][:, :k]
    rms = np.sqrt((w[:, None] * proj**2).sum() / max(1, k))
    if rms > 0:
        proj *= EXPOSURE_RMS / rms
    out[np.flatnonzero(seen), :k] = proj
    return out


def exposure_init(weight: torch.nn.Parameter, core: FeatureCore, names: Sequence[str], offsets: Sequence[int],
                  users: np.ndarray, items: np.ndarray) -> str | None:
    """Write the exposure vectors of ``EXPOSURE_COLUMN``'s table into ``weight`` from the impressions
    (``users``, ``items``); ``names`` and ``offsets`` are the fused table's columns (user columns, then
    item columns) and their first rows. Returns the column's name, or None when the table is absent."""
    if EXPOSURE_COLUMN not in names:
        return None
    t = names.index(EXPOSURE_COLUMN)
    column = t - (len(names) - len(core.preprocessor.sparse_names("items")))
    size = core.preprocessor.table_sizes("items")[column]
    vectors = exposure_vectors(core.user_continuous, users, core.item_sparse[items, column], size,
                               int(weight.shape[1]))
    with torch.no_grad():
        weight[offsets[t] : offsets[t] + size] = torch.from_numpy(vectors).to(weight.device, weight.dtype)
    return EXPOSURE_COLUMN
