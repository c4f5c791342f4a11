"""The compiled CPU forward for a batch of users: two compiled parts around one matmul per user.

The factorised forward (``recpipe.ranking.factorised._UserSplit``) folds each user's vectors into the
first layer's item columns, so its candidates need that user's own weights: one matmul per user. A
compiled forward for one user pays a fixed cost per call (oneDNN sets up each bf16 matmul for about
15 µs, ten of them; the wrappers and the copies in), about 300 µs of a 600-µs forward at 500
candidates here. Run one user at a time, a batch of B users paid it B times.

The segmented form pays it once per batch:

1. ``prepare`` (compiled, dynamic shapes): every user's h0 and folded weights, and every candidate's
   vectors and item x item dots, for the whole batch in one call;
2. one ``addmm`` per user over its contiguous candidates: ``h0[i] + items_i @ folded[i].T``;
3. ``finish`` (compiled): the item x item part of the first layer, the rest of the top MLP, the wide
   part and the sigmoid over all the batch's candidates.

Each candidate's row goes through the same operations whatever else is in the batch (the matmuls'
rows do not depend on each other), so a query's scores are the same alone and in any batch: a lone
query runs this form too (B = 1), at about 70 µs more than the one-graph forward it replaced, and a
batch of 4 x 500 costs 0.59-0.72x as much per query (``recpipe bench ranking --requests 4``, bf16,
2-core EPYC; BENCHMARKS.md).

The inputs come padded to the predictor's buckets (users and rows) like every compiled form, so the
compiled parts see only warmed shapes; each user's matmul takes exactly its own rows, so it has the same
height alone and in a batch (nothing promises a matmul's rows round the same at another height), and the
padded rows get zeros there. Users are padded to at least 2 (``Predictor._bucketed``): torch.compile
specializes a size of 1, and that graph rounded some users' wide part differently. Shapes not warmed run
the same parts eagerly (never a compile on the request path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from recpipe.accel.transfer import DeviceIO


class _Prepare(nn.Module):
    def __init__(self, split: nn.Module) -> None:
        super().__init__()
        self.split = split

    def forward(self, ud: torch.Tensor, us: torch.Tensor, idn: torch.Tensor,
                isp: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.split.prepare(ud, us, idn, isp)  # type: ignore[no-any-return,operator]


class _Finish(nn.Module):
    def __init__(self, split: nn.Module) -> None:
        super().__init__()
        self.split = split

    def forward(self, h_items: torch.Tensor, vv: torch.Tensor, ud: torch.Tensor, idn: torch.Tensor,
                item_emb: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        return self.split.finish(h_items, vv, ud, idn, item_emb, seg)  # type: ignore[no-any-return,operator]


def supports_segments(split: nn.Module) -> bool:
    """Whether ``split`` has the two parts (the dot interaction's split; the DCN's has no fold)."""
    return callable(getattr(split, "prepare", None)) and callable(getattr(split, "finish", None))


class SegmentedForward:
    """``split``'s segmented form over one device's staging buffers: its parts compiled, and the same
    parts eager for shapes that were not warmed."""

    def __init__(self, split: nn.Module, io: DeviceIO) -> None:
        self.io = io
        eager: tuple[nn.Module, nn.Module] = (_Prepare(split), _Finish(split))
        compiled = tuple(torch.compile(part, dynamic=True) for part in eager)
        #: (prepare, finish) by whether they run compiled
        self._parts: dict[bool, tuple[Callable[..., Any], Callable[..., Any]]] = {
            False: eager, True: (compiled[0], compiled[1])}

    def __call__(self, user_dense: np.ndarray, user_sparse: np.ndarray, item_dense: np.ndarray,
                 item_sparse: np.ndarray, counts: Sequence[int], users: int, rows: int,
                 compiled: bool = True) -> np.ndarray:
        """(B, Du), (B, U), (N, Di), (N, I) with N = sum(counts), padded to ``users`` >= B and ``rows``
        >= N -> (N,) float32 probabilities; ``compiled`` False runs the parts eagerly."""
        b, n = len(counts), int(sum(counts))
        io = self.io
        prepare, finish = self._parts[compiled]
        with torch.inference_mode():
            ud = io.put("user_dense", user_dense, np.float32, users)
            idn = io.put("item_dense", item_dense, np.float32, rows)
            h0, folded, flat, vv, item_emb = prepare(
                ud, io.put("user_sparse", user_sparse, np.int64, users), idn,
                io.put("item_sparse", item_sparse, np.int64, rows))
            parts, start = [], 0
            for i, count in enumerate(counts):
                if count:  # exactly the user's rows: the same matmul alone and in any batch
                    parts.append(torch.addmm(h0[i], flat[start : start + count], folded[i].T))
                    start += count
            if rows > n:  # the padded rows' first layer is nobody's: zeros
                parts.append(h0.new_zeros((rows - n, h0.shape[1])))
            seg = io.put("segments", np.repeat(np.arange(b, dtype=np.int64), counts), np.int64, rows)
            scores = finish(torch.cat(parts) if len(parts) > 1 else parts[0], vv, ud, idn, item_emb, seg)
            return io.fetch("scores", scores, n)
