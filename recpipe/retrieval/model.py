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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from recpipe.nn import FusedEmbedding, mlp
from recpipe.retrieval.config import TwoTowerConfig
from recpipe.retrieval.folded import FoldedUserTower, Layer


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

    def folded(self) -> FoldedUserTower:
        """This tower folded into numpy for the CPU (``recpipe.retrieval.folded``)."""

        def array(t: torch.Tensor) -> np.ndarray:
            return t.detach().float().cpu().numpy()

        layers: list[Layer] = []
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                layers.append((array(layer.weight), array(layer.bias)))
            elif isinstance(layer, nn.ReLU):
                layers.append(None)
            else:
                raise TypeError(f"cannot fold a {type(layer).__name__} in the user tower")
        return FoldedUserTower(array(self.embedding.weight), self.embedding.offsets.cpu().numpy(), layers)


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
