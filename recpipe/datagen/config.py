"""What the user chooses about a dataset: scale and seed (the click model's knobs live in ``click_model``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from recpipe import schema
from recpipe.errors import UsageError

MAX_SEED = 2**63 - 1
#: Beyond this the row counts no longer fit a disk, let alone memory; refuse early with a clear message.
MAX_SCALE = 100.0


def check_seed(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise UsageError(f"seed must be an integer in 0..{MAX_SEED}, got {value!r}")
    return value


def check_scale(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"scale must be a number > 0, got {value!r}")
    f = float(value)
    if not math.isfinite(f) or f <= 0:
        raise UsageError(f"scale must be a finite number > 0, got {value!r}")
    if f > MAX_SCALE:
        raise UsageError(f"scale must be <= {MAX_SCALE:g}, got {value!r}")
    return f


@dataclass(frozen=True)
class DatagenConfig:
    """One dataset: ``scale`` multiplies every row count (schema.Table.rows_at), ``seed`` fixes every byte."""

    scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", check_scale(self.scale))
        check_seed(self.seed)

    @property
    def n_users(self) -> int:
        return schema.USERS.rows_at(self.scale)

    @property
    def n_items(self) -> int:
        return schema.ITEMS.rows_at(self.scale)

    @property
    def n_interactions(self) -> int:
        return schema.INTERACTIONS.rows_at(self.scale)

    def cardinality(self, table: schema.Table, column: str) -> int:
        return table.column(column).cardinality_at(self.scale)
