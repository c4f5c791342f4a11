"""The user tower folded for the CPU, in numpy: what the retrieval stage runs there, without torch.

``FoldedUserTower`` is built from the tower's float32 weights, either from the torch module
(``Tower.folded()``) or straight from the repository's safetensors file
(``artifacts.load_folded_user_tower``: no torch imported); both give bit-identical folds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from recpipe.retrieval.config import TwoTowerConfig

#: One layer of the tower's MLP: (weight (out, in), bias (out,)) of a Linear, or None for a ReLU.
Layer = tuple[np.ndarray, np.ndarray] | None


def table_offsets(table_sizes: Sequence[int]) -> np.ndarray:
    """Each table's first row in the fused embedding weight (``recpipe.nn.FusedEmbedding.offsets``)."""
    sizes = np.asarray(table_sizes, dtype=np.int64)
    offsets = np.zeros(len(sizes), np.int64)
    offsets[1:] = np.cumsum(sizes[:-1])
    return offsets


def _mlp_dims(cfg: TwoTowerConfig) -> list[int]:
    return [cfg.user_dense_dim + len(cfg.user_table_sizes) * cfg.embedding_dim, *cfg.hidden_dims, cfg.out_dim]


def user_tower_shapes(cfg: TwoTowerConfig) -> dict[str, tuple[int, ...]]:
    """The user tower's tensors by name and shape, as ``Tower.state_dict()`` holds them: the fused
    embedding, then the Linear layers of ``recpipe.nn.mlp`` at even positions (a ReLU between each pair,
    none after the last)."""
    dims = _mlp_dims(cfg)
    shapes: dict[str, tuple[int, ...]] = {"embedding.weight": (sum(cfg.user_table_sizes), cfg.embedding_dim)}
    for i in range(len(dims) - 1):
        shapes[f"mlp.{2 * i}.weight"] = (dims[i + 1], dims[i])
        shapes[f"mlp.{2 * i}.bias"] = (dims[i + 1],)
    return shapes


class FoldedUserTower:
    """The user tower folded for the CPU, in numpy: (B, Du) float32 + (B, T) int64 -> (B, out) float32.

    The first Linear after the embedding concat is linear in each table's embedding, so each table's
    rows are projected through their slice of its weight once, at load: the lookup, the concat and
    most of the first layer become one gather of T rows of width H and a sum. For one user this is a
    few numpy calls instead of ~10 torch dispatches (the tower was ~60% of a served retrieve on the CPU).
    Same function as ``Tower.forward`` up to float32 summation order.

    ``embedding``: the fused (sum(sizes), E) weight, ``offsets`` its tables' first rows, ``layers`` the
    MLP in order, a Linear first.
    """

    def __init__(self, embedding: np.ndarray, offsets: np.ndarray, layers: Sequence[Layer]) -> None:
        first = layers[0]
        if first is None:
            raise TypeError("the user tower's MLP must start with a Linear to be folded")
        emb = np.asarray(embedding, dtype=np.float32)
        w1 = np.asarray(first[0], dtype=np.float32)  # (H, Du + T*E)
        b1 = np.asarray(first[1], dtype=np.float32)
        n_tables, e = len(offsets), emb.shape[1]
        du = w1.shape[1] - n_tables * e
        bounds = [*np.asarray(offsets).tolist(), emb.shape[0]]
        proj = np.empty((emb.shape[0], w1.shape[0]), np.float32)
        for t in range(n_tables):
            cols = w1[:, du + t * e : du + (t + 1) * e]  # (H, E)
            proj[bounds[t] : bounds[t + 1]] = emb[bounds[t] : bounds[t + 1]] @ cols.T
        self.offsets = np.asarray(offsets).astype(np.int64)
        self.proj = proj
        self.w_dense = np.ascontiguousarray(w1[:, :du].T)
        self.b1 = b1
        self.rest: list[tuple[np.ndarray, np.ndarray] | None] = []  # (W^T, b) per Linear, None per ReLU
        for layer in layers[1:]:
            self.rest.append(None if layer is None else (np.ascontiguousarray(np.asarray(layer[0], np.float32).T),
                                                         np.asarray(layer[1], dtype=np.float32)))

    @classmethod
    def from_state(cls, state: Mapping[str, np.ndarray], cfg: TwoTowerConfig) -> FoldedUserTower:
        """From the user tower's tensors by ``Tower.state_dict()`` name (``user_tower_shapes``, checked by
        the caller)."""
        layers: list[Layer] = []
        for i in range(len(_mlp_dims(cfg)) - 1):
            if i:
                layers.append(None)
            layers.append((state[f"mlp.{2 * i}.weight"], state[f"mlp.{2 * i}.bias"]))
        return cls(state["embedding.weight"], table_offsets(cfg.user_table_sizes), layers)

    def __call__(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        # overflowing input gives inf/NaN rows, as in torch; the caller reports them (recpipe.finite)
        with np.errstate(over="ignore", invalid="ignore"):
            h = dense @ self.w_dense
            h += self.b1
            h += self.proj[sparse + self.offsets].sum(axis=1)
            for layer in self.rest:
                if layer is None:
                    np.maximum(h, 0, out=h)
                else:
                    h = h @ layer[0]
                    h += layer[1]
            norm = np.sqrt(np.einsum("ij,ij->i", h, h))[:, None]
            return (h / np.maximum(norm, 1e-12)).astype(np.float32, copy=False)
