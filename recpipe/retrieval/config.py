"""The two-tower model's configuration (``retrieval/two_tower.json``), apart from the torch model so
that reading it imports no torch."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from recpipe.errors import ArtifactMismatch


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
