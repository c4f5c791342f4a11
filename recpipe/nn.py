"""Neural-network pieces both models are built from: the MLP, the fused embedding, weight loading.

The two-tower model (``recpipe.retrieval.model``) and DLRM (``recpipe.ranking.model``) import these
from here, as torchrec's models share ``modules/mlp.py``; neither model imports the other.

Example::

    emb = FusedEmbedding((5, 7), dim=4)
    emb(torch.tensor([[0, 6]])).shape        # (1, 2, 4): table 0 row 0, table 1 row 6
    mlp([8, 16, 1], final_activation=False)  # Linear(8,16), ReLU, Linear(16,1)
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from recpipe.errors import ArtifactMismatch


class FusedEmbedding(nn.Module):
    """T tables in one (sum(sizes), D) weight; ids (B, T) local per table -> (B, T, D), one lookup."""

    offsets: torch.Tensor

    def __init__(self, table_sizes: tuple[int, ...], dim: int) -> None:
        super().__init__()
        offsets = torch.zeros(len(table_sizes), dtype=torch.long)
        if len(table_sizes) > 1:
            offsets[1:] = torch.cumsum(torch.tensor(table_sizes[:-1], dtype=torch.long), 0)
        self.register_buffer("offsets", offsets, persistent=False)
        self.weight = nn.Parameter(torch.empty(sum(table_sizes), dim))
        nn.init.normal_(self.weight, std=0.05)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids + self.offsets, self.weight)


def mlp(dims: list[int], final_activation: bool = True) -> nn.Sequential:
    """Linear layers over ``dims`` with a ReLU between each pair (and after the last one if asked)."""
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2 or final_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def load_state(path: Path, module: nn.Module, prefix: str = "") -> None:
    """Load ``prefix``-ed tensors of a safetensors file into ``module``; any mismatch names the file."""
    try:
        state = load_file(str(path))
    except Exception as e:
        raise ArtifactMismatch(f"{path}: unreadable safetensors ({e})") from None
    if prefix:
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0:3]
        raise ArtifactMismatch(f"{path}: weights do not match the model config ({' '.join(first)})") from None


def save_state(path: Path, module: nn.Module) -> None:
    """Write ``module``'s tensors as float32 safetensors (whatever precision or device it trained in)."""
    save_file({k: v.detach().float().contiguous().cpu() for k, v in module.state_dict().items()}, str(path))
