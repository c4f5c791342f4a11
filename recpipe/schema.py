"""The dataset schema as data: tables, row counts at scale 1, columns, dtypes, cardinalities.

Used by the generator (``recpipe.datagen``), by training (``recpipe.preprocess``) and by the services,
so all of them agree on names, dtypes and sizes. Column *names* are a contract (``u_cont_00`` ...);
the ``meaning`` strings document what a column stands for in the e-commerce story the data tells.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

SCHEMA_VERSION: Final[int] = 1


class Kind(StrEnum):
    ID = "id"
    CONTINUOUS = "continuous"
    CATEGORICAL = "categorical"
    LABEL = "label"
    TIMESTAMP = "timestamp"


@dataclass(frozen=True)
class Column:
    """One column of a table.

    ``cardinality`` (categoricals only) is the number of distinct values at scale 1; values are
    ``0..cardinality-1``. When ``scales`` is true the cardinality grows with the table's row count
    (brand, shop: a 10x bigger catalogue has ~10x more shops), never below ``min_cardinality``.
    ``null_rate`` is the share of missing values the generator writes (continuous only);
    ``heavy_tailed`` marks columns whose values span orders of magnitude (log1p before normalising).
    """

    name: str
    dtype: str  # a Polars/NumPy dtype name: "int64", "int32", "int8", "float32"
    kind: Kind
    meaning: str = ""
    cardinality: int = 0
    scales: bool = False
    min_cardinality: int = 2
    null_rate: float = 0.0
    heavy_tailed: bool = False

    def __post_init__(self) -> None:
        if self.kind is Kind.CATEGORICAL and self.cardinality < 2:
            raise ValueError(f"categorical column {self.name} needs cardinality >= 2")
        if not 0.0 <= self.null_rate < 1.0:
            raise ValueError(f"column {self.name}: null_rate must be in [0, 1)")

    def cardinality_at(self, scale: float) -> int:
        """Distinct values of this categorical column at ``scale``."""
        if not self.scales:
            return self.cardinality
        return max(self.min_cardinality, round(self.cardinality * scale))


@dataclass(frozen=True)
class Table:
    name: str
    rows: int  # at scale 1
    columns: tuple[Column, ...]

    def rows_at(self, scale: float) -> int:
        """Rows at ``scale``: linear in scale, rounded, at least 1."""
        return max(1, round(self.rows * scale))

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def of_kind(self, kind: Kind) -> tuple[Column, ...]:
        return tuple(c for c in self.columns if c.kind is kind)

    @property
    def continuous(self) -> tuple[Column, ...]:
        return self.of_kind(Kind.CONTINUOUS)

    @property
    def categorical(self) -> tuple[Column, ...]:
        return self.of_kind(Kind.CATEGORICAL)

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"{self.name} has no column {name!r}")


def _cont(prefix: str, i: int, meaning: str = "", null_rate: float = 0.0, heavy: bool = False) -> Column:
    return Column(f"{prefix}_cont_{i:02d}", "float32", Kind.CONTINUOUS, meaning, null_rate=null_rate,
                  heavy_tailed=heavy)


def _cat(prefix: str, i: int, card: int, meaning: str = "", scales: bool = False, min_card: int = 2) -> Column:
    return Column(f"{prefix}_cat_{i:02d}", "int32", Kind.CATEGORICAL, meaning, cardinality=card,
                  scales=scales, min_cardinality=min_card)


# --- users: 40 continuous + 44 categorical -------------------------------------------------------

_USER_CONT_MEANINGS: dict[int, tuple[str, float, bool]] = {
    # index: (meaning, null_rate, heavy_tailed)
    0: ("age in years", 0.02, False),
    1: ("account age in days", 0.0, True),
    2: ("total spend, last 90 days", 0.03, True),
    3: ("orders, last 90 days", 0.0, True),
    4: ("sessions per week", 0.01, True),
    5: ("mean basket value", 0.04, True),
    6: ("discount sensitivity", 0.02, False),
    7: ("return rate", 0.05, False),
}
USER_CONTINUOUS: Final[tuple[Column, ...]] = tuple(
    _cont("u", i, *_USER_CONT_MEANINGS.get(i, ("latent taste signal", 0.0, False))) for i in range(40)
)

# (cardinality at scale 1, meaning, scales with rows, minimum cardinality)
_USER_CATS: list[tuple[int, str, bool, int]] = [
    (4, "consumption level", False, 2),
    (3, "gender (incl. unknown)", False, 2),
    (8, "age bucket", False, 2),
    (5, "city tier", False, 2),
    (400, "city", False, 2),
    (35, "province", False, 2),
    (12, "occupation", False, 2),
    (6, "education", False, 2),
    (3, "marital status", False, 2),
    (4, "has children", False, 2),
    (30, "preferred category (top level)", False, 2),
    (1000, "preferred category (leaf)", False, 2),
    (5, "membership tier", False, 2),
    (24, "most active hour", False, 2),
    (7, "most active weekday", False, 2),
    (6, "device type", False, 2),
    (2000, "device model", False, 2),
    (4, "os", False, 2),
    (60, "app version", False, 2),
    (10, "acquisition channel", False, 2),
    (20, "payment method", False, 2),
    (8, "price band preference", False, 2),
    (50, "interest cluster", False, 2),
    (200, "interest cluster (fine)", False, 2),
    (16, "lifestyle segment", False, 2),
    (3, "shopping frequency band", False, 2),
    (100, "language/region", False, 2),
    (5, "coupon usage band", False, 2),
    (9, "delivery preference", False, 2),
    (40, "favourite brand family", False, 2),
    (20_000, "favourite brand", True, 50),
    (50_000, "most visited shop", True, 100),
    (12, "signup month", False, 2),
    (10, "signup year", False, 2),
    (4, "loyalty status", False, 2),
    (150, "campaign cohort", False, 2),
    (3, "newsletter opt-in", False, 2),
    (6, "household size", False, 2),
    (25, "hobby", False, 2),
    (500, "postal area", False, 2),
    (8, "credit band", False, 2),
    (70, "social segment", False, 2),
    (2, "is vip", False, 2),
    (300, "referrer", False, 2),
]
USER_CATEGORICAL: Final[tuple[Column, ...]] = tuple(
    _cat("u", i, card, meaning, scales, min_card) for i, (card, meaning, scales, min_card) in enumerate(_USER_CATS)
)

# --- items: 20 continuous + 16 categorical -------------------------------------------------------

_ITEM_CONT_MEANINGS: dict[int, tuple[str, float, bool]] = {
    0: ("price", 0.01, True),
    1: ("stock", 0.03, True),
    2: ("rating", 0.05, False),
    3: ("review count", 0.0, True),
    4: ("discount rate", 0.02, False),
    5: ("days since listed", 0.0, True),
    6: ("shipping days", 0.02, False),
    7: ("seller score", 0.01, False),
}
ITEM_CONTINUOUS: Final[tuple[Column, ...]] = tuple(
    _cont("i", i, *_ITEM_CONT_MEANINGS.get(i, ("latent quality signal", 0.0, False))) for i in range(20)
)

_ITEM_CATS: list[tuple[int, str, bool, int]] = [
    (1000, "category (leaf)", False, 2),
    (30, "category (top level)", False, 2),
    (200_000, "brand", True, 50),
    (600_000, "shop", True, 100),
    (8, "price band", False, 2),
    (12, "colour", False, 2),
    (10, "size class", False, 2),
    (5, "condition", False, 2),
    (50, "origin country", False, 2),
    (20, "material", False, 2),
    (6, "target gender/age", False, 2),
    (4, "season", False, 2),
    (15, "shipping class", False, 2),
    (3, "is promoted", False, 2),
    (100, "seller region", False, 2),
    (40, "tag cluster", False, 2),
]
ITEM_CATEGORICAL: Final[tuple[Column, ...]] = tuple(
    _cat("i", i, card, meaning, scales, min_card) for i, (card, meaning, scales, min_card) in enumerate(_ITEM_CATS)
)

USERS: Final[Table] = Table(
    "users",
    221_000,
    (Column("user_id", "int64", Kind.ID, "user id, 0..n-1"), *USER_CONTINUOUS, *USER_CATEGORICAL),
)
ITEMS: Final[Table] = Table(
    "items",
    850_000,
    (Column("item_id", "int64", Kind.ID, "item id, 0..n-1"), *ITEM_CONTINUOUS, *ITEM_CATEGORICAL),
)
INTERACTIONS: Final[Table] = Table(
    "interactions",
    4_000_000,
    (
        Column("user_id", "int64", Kind.ID, "who saw the item"),
        Column("item_id", "int64", Kind.ID, "which item was shown"),
        Column("label", "int8", Kind.LABEL, "1 = clicked, 0 = shown but not clicked"),
        Column("timestamp", "int64", Kind.TIMESTAMP, "seconds since the epoch"),
    ),
)

TABLES: Final[tuple[Table, ...]] = (USERS, ITEMS, INTERACTIONS)
TABLE_FILES: Final[dict[str, str]] = {t.name: f"{t.name}.parquet" for t in TABLES}

#: Share of interactions (the latest by timestamp) held out for evaluation, by the generator's oracle
#: and by training alike.
HOLDOUT_FRACTION: Final[float] = 0.10

assert len(USER_CONTINUOUS) == 40 and len(USER_CATEGORICAL) == 44
assert len(ITEM_CONTINUOUS) == 20 and len(ITEM_CATEGORICAL) == 16
