"""Two-tower retrieval model: a user tower and an item tower into one L2-normalised embedding space.

Each tower: fused embedding lookup over its categorical tables (one weight, per-table offsets),
concatenated with the dense features, an MLP, L2 normalisation. Trained with in-batch sampled softmax
over clicked (user, item) pairs with the logQ correction for popularity-proportional negatives.

Example::

    cfg = TwoTowerConfig(user_dense_dim=43, item_dense_dim=22, user_table_sizes=(5,) * 44,
                         item_table_sizes=(7,) * 16)
    model = TwoTower(cfg)
    u = model.user_tower(torch.randn(8, 43), torch.zeros(8, 44, dtype=torch.long))   # (8, 64)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from recpipe.errors import ArtifactMismatch
from recpipe.nn import FusedEmbedding, mlp


@dataclass(frozen=True)
class TwoTowerConfig:
    user_dense_dim: int
    item_dense_dim: int
    user_table_sizes: tuple[int, ...]
    item_table_sizes: tuple[int, ...]
    embedding_dim: int = 16
    hidden_dims: tuple[int, ...] = (128,)
    out_dim: int = 64
    temperature: float = 0.05

    def __post_init__(self) -> None:
        if min(self.user_table_sizes + self.item_table_sizes, default=1) < 1:
            raise ValueError("embedding tables need at least one row")
        if self.out_dim < 1 or self.embedding_dim < 1 or self.temperature <= 0:
            raise ValueError("out_dim and embedding_dim must be >= 1, temperature > 0")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "config") -> TwoTowerConfig:
        try:
            return cls(
                user_dense_dim=int(data["user_dense_dim"]),
                item_dense_dim=int(data["item_dense_dim"]),
                user_table_sizes=tuple(int(x) for x in data["user_table_sizes"]),
                item_table_sizes=tuple(int(x) for x in data["item_table_sizes"]),
                embedding_dim=int(data["embedding_dim"]),
                hidden_dims=tuple(int(x) for x in data["hidden_dims"]),
                out_dim=int(data["out_dim"]),
                temperature=float(data["temperature"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactMismatch(f"{source}: malformed two-tower config ({e!r})") from None

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


class Tower(nn.Module):
    """dense (B, Dd) float32 + sparse (B, T) int64 -> (B, out_dim) unit vectors."""

    def __init__(self, dense_dim: int, table_sizes: tuple[int, ...], emb_dim: int, hidden: tuple[int, ...],
                 out_dim: int) -> None:
        super().__init__()
        self.embedding = FusedEmbedding(table_sizes, emb_dim)
        self.mlp = mlp([dense_dim + len(table_sizes) * emb_dim, *hidden, out_dim], final_activation=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = torch.cat([dense, self.embedding(sparse).flatten(1)], dim=1)
        return F.normalize(self.mlp(x), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, config: TwoTowerConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.user_tower = Tower(c.user_dense_dim, c.user_table_sizes, c.embedding_dim, c.hidden_dims, c.out_dim)
        self.item_tower = Tower(c.item_dense_dim, c.item_table_sizes, c.embedding_dim, c.hidden_dims, c.out_dim)

    def in_batch_loss(
        self,
        user: torch.Tensor,
        item: torch.Tensor,
        item_ids: torch.Tensor,
        log_q: torch.Tensor,
    ) -> torch.Tensor:
        """Sampled softmax over the batch's items.

        user, item: (B, D) embeddings of B clicked pairs; item_ids (B,); log_q (B,) log sampling
        probability of each item (its share of clicks). Subtracting log_q undoes the popularity bias
        of in-batch negatives; other rows holding the same item are masked, not counted as negatives.
        """
        logits = user @ item.T / self.config.temperature - log_q[None, :]
        same = item_ids[None, :] == item_ids[:, None]
        same.fill_diagonal_(False)
        logits = logits.masked_fill(same, float("-inf"))
        return F.cross_entropy(logits, torch.arange(user.shape[0], device=user.device))


class FoldedUserTower:
    """The user tower folded for the CPU, in numpy: (B, Du) float32 + (B, T) int64 -> (B, out) float32.

    The first Linear after the embedding concat is linear in each table's embedding, so each table's
    rows are projected through their slice of its weight once, at load: the lookup, the concat and
    most of the first layer become one gather of T rows of width H and a sum. For one user this is a
    few numpy calls instead of ~10 torch dispatches (the tower was ~60% of a served retrieve on the CPU).
    Same function as ``Tower.forward`` up to float32 summation order.
    """

    def __init__(self, tower: Tower) -> None:
        with torch.no_grad():
            emb = tower.embedding.weight.detach().float().cpu().numpy()
            offsets = tower.embedding.offsets.cpu().numpy()
            layers = list(tower.mlp)
            first = layers[0]
            assert isinstance(first, nn.Linear)
            w1 = first.weight.detach().float().cpu().numpy()  # (H, Du + T*E)
            b1 = first.bias.detach().float().cpu().numpy()
        n_tables, e = len(offsets), emb.shape[1]
        du = w1.shape[1] - n_tables * e
        bounds = [*offsets.tolist(), emb.shape[0]]
        proj = np.empty((emb.shape[0], w1.shape[0]), np.float32)
        for t in range(n_tables):
            cols = w1[:, du + t * e : du + (t + 1) * e]  # (H, E)
            proj[bounds[t] : bounds[t + 1]] = emb[bounds[t] : bounds[t + 1]] @ cols.T
        self.offsets = offsets.astype(np.int64)
        self.proj = proj
        self.w_dense = np.ascontiguousarray(w1[:, :du].T)
        self.b1 = b1
        self.rest: list[tuple[np.ndarray, np.ndarray] | None] = []  # (W^T, b) per Linear, None per ReLU
        for layer in layers[1:]:
            if isinstance(layer, nn.Linear):
                self.rest.append((np.ascontiguousarray(layer.weight.detach().float().cpu().numpy().T),
                                  layer.bias.detach().float().cpu().numpy()))
            elif isinstance(layer, nn.ReLU):
                self.rest.append(None)
            else:
                raise TypeError(f"cannot fold a {type(layer).__name__} in the user tower")

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
