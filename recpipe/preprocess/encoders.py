"""Categorify + normalize + fill-missing, fitted on the training split, applied as Polars expressions.

Artifacts (no pickles): ``vocab_<table>.parquet`` (column, value, index, count) and ``stats.json``
(per continuous column: log1p?, mean, std; per categorical column: vocabulary size).

Encoding of one table (users or items) gives ``dense`` (n, #continuous) float32 — log1p for
heavy-tailed columns, then (x - mean) / std, missing -> 0 (the mean) — and ``sparse``
(n, #categorical) int64 local ids, 0 = null/unseen, 1.. = frequency rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from recpipe import schema
from recpipe.errors import ArtifactMismatch, clip
from recpipe.files import write_atomic
from recpipe.preprocess.config import PreprocessConfig

TABLES: dict[str, schema.Table] = {"users": schema.USERS, "items": schema.ITEMS}
STATS_FILE = "stats.json"
#: the columns of ``vocab_<table>.parquet`` (one row per value of each categorical column)
VOCAB_SCHEMA = {"column": pl.String, "value": pl.Int64, "index": pl.Int64, "count": pl.Int64}


def vocab_file(table: str) -> str:
    return f"vocab_{table}.parquet"


@dataclass(frozen=True)
class ContinuousStats:
    name: str
    log1p: bool
    mean: float
    std: float


@dataclass(frozen=True)
class Vocabulary:
    """Raw values in frequency order; ``values[j]`` encodes to ``j + 1``."""

    name: str
    values: np.ndarray  # (V-1,) int64
    counts: np.ndarray  # (V-1,) int64

    @property
    def size(self) -> int:
        """Embedding rows this column needs, bucket 0 included."""
        return int(self.values.shape[0]) + 1


@dataclass(frozen=True)
class EncodedTable:
    """dense: (n, C) float32 encoded continuous columns; sparse: (n, K) int64 local categorical ids."""

    dense: np.ndarray
    sparse: np.ndarray


class Preprocessor:
    """Fitted encoders for the users and items tables."""

    def __init__(
        self,
        config: PreprocessConfig,
        continuous: dict[str, list[ContinuousStats]],
        vocabs: dict[str, list[Vocabulary]],
    ) -> None:
        self.config = config
        self.continuous = continuous
        self.vocabs = vocabs
        for table, spec in TABLES.items():
            if [c.name for c in continuous[table]] != [c.name for c in spec.continuous]:
                raise ArtifactMismatch(f"{STATS_FILE}: continuous columns of {table} do not match the schema")
            if [v.name for v in vocabs[table]] != [c.name for c in spec.categorical]:
                raise ArtifactMismatch(f"{vocab_file(table)}: categorical columns do not match the schema")

    # ---- fit ---------------------------------------------------------------------------------------

    @classmethod
    def fit(cls, users: pl.DataFrame, items: pl.DataFrame, config: PreprocessConfig | None = None) -> Preprocessor:
        """Fit on the rows of the users and items that occur in the training split."""
        config = config or PreprocessConfig()
        frames = {"users": users, "items": items}
        continuous: dict[str, list[ContinuousStats]] = {}
        vocabs: dict[str, list[Vocabulary]] = {}
        for table, spec in TABLES.items():
            frame = frames[table]
            exprs = []
            for c in spec.continuous:
                x = pl.col(c.name).cast(pl.Float64)
                if c.heavy_tailed:
                    x = x.clip(lower_bound=0.0).log1p()
                x = x.fill_nan(None)
                exprs += [x.mean().alias(f"{c.name}/mean"), x.std().alias(f"{c.name}/std")]
            row = frame.select(exprs).row(0, named=True) if frame.height else {}
            stats = []
            for c in spec.continuous:
                mean = row.get(f"{c.name}/mean")
                std = row.get(f"{c.name}/std")
                mean = 0.0 if mean is None else float(mean)
                std = 1.0 if std is None or not np.isfinite(std) or std < 1e-8 else float(std)
                stats.append(ContinuousStats(c.name, c.heavy_tailed, mean, std))
            continuous[table] = stats
            vocabs[table] = [cls._fit_vocab(frame, c.name, config.max_vocab) for c in spec.categorical]
        return cls(config, continuous, vocabs)

    @staticmethod
    def _fit_vocab(frame: pl.DataFrame, name: str, max_vocab: int) -> Vocabulary:
        counts = (
            frame.select(pl.col(name).cast(pl.Int64))
            .drop_nulls()
            .group_by(name)
            .len()
            .sort(["len", name], descending=[True, False])
            .head(max_vocab - 1)
        )
        return Vocabulary(name, counts[name].to_numpy().astype(np.int64), counts["len"].to_numpy().astype(np.int64))

    # ---- apply -------------------------------------------------------------------------------------

    def dense_names(self, table: str) -> list[str]:
        return [s.name for s in self.continuous[table]]

    def sparse_names(self, table: str) -> list[str]:
        return [v.name for v in self.vocabs[table]]

    def table_sizes(self, table: str) -> list[int]:
        """Embedding rows per categorical column of ``table`` (bucket 0 included)."""
        return [v.size for v in self.vocabs[table]]

    def expressions(self, table: str) -> list[pl.Expr]:
        """The encoding of ``table`` as Polars expressions: continuous columns then categorical ones."""
        exprs: list[pl.Expr] = []
        for s in self.continuous[table]:
            x = pl.col(s.name).cast(pl.Float64)
            if s.log1p:
                x = x.clip(lower_bound=0.0).log1p()
            exprs.append(((x - s.mean) / s.std).fill_nan(None).fill_null(0.0).cast(pl.Float32).alias(s.name))
        for v in self.vocabs[table]:
            codes = pl.col(v.name).cast(pl.Int64).replace_strict(
                pl.Series(v.values, dtype=pl.Int64),
                pl.Series(np.arange(1, v.size, dtype=np.int64)),
                default=0,
                return_dtype=pl.Int64,
            )
            exprs.append(codes.fill_null(0).alias(v.name))
        return exprs

    def encode(self, table: str, frame: pl.DataFrame | pl.LazyFrame) -> EncodedTable:
        """Encode all rows of ``frame`` (in order) with ``expressions(table)``."""
        out = frame.lazy().select(self.expressions(table)).collect()
        dense_cols = self.dense_names(table)
        sparse_cols = self.sparse_names(table)
        dense = out.select(dense_cols).to_numpy().astype(np.float32, copy=False)
        sparse = out.select(sparse_cols).to_numpy().astype(np.int64, copy=False)
        return EncodedTable(np.ascontiguousarray(dense), np.ascontiguousarray(sparse))

    # ---- artifacts ---------------------------------------------------------------------------------

    def save(self, directory: Path) -> list[Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for table in TABLES:
            frame = pl.concat(
                [
                    pl.DataFrame(
                        {
                            "column": [v.name] * (v.size - 1),
                            "value": v.values,
                            "index": np.arange(1, v.size, dtype=np.int64),
                            "count": v.counts,
                        },
                        schema=VOCAB_SCHEMA,
                    )
                    for v in self.vocabs[table]
                ]
            )
            path = directory / vocab_file(table)
            write_atomic(path, frame.write_parquet, force=True)
            written.append(path)
        stats: dict[str, Any] = {
            "max_vocab": self.config.max_vocab,
            "tables": {
                table: {
                    "continuous": [
                        {"name": s.name, "log1p": s.log1p, "mean": s.mean, "std": s.std} for s in self.continuous[table]
                    ],
                    "categorical": [{"name": v.name, "size": v.size} for v in self.vocabs[table]],
                }
                for table in TABLES
            },
        }
        from recpipe.repository import write_json

        write_json(directory / STATS_FILE, stats)
        written.append(directory / STATS_FILE)
        return written

    @classmethod
    def load(cls, stats_path: Path, vocab_paths: dict[str, Path]) -> Preprocessor:
        """Load from ``stats.json`` and one vocabulary Parquet per table (paths already verified)."""
        from recpipe.repository import read_json

        stats = read_json(stats_path)
        try:
            config = PreprocessConfig(max_vocab=int(stats["max_vocab"]))
            continuous = {
                table: [
                    ContinuousStats(str(s["name"]), bool(s["log1p"]), float(s["mean"]), float(s["std"]))
                    for s in stats["tables"][table]["continuous"]
                ]
                for table in TABLES
            }
            sizes = {
                table: {str(c["name"]): int(c["size"]) for c in stats["tables"][table]["categorical"]} for table in TABLES
            }
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactMismatch(f"{stats_path}: malformed preprocessing stats ({e!r})") from None
        vocabs: dict[str, list[Vocabulary]] = {}
        for table, spec in TABLES.items():
            path = vocab_paths[table]
            try:
                frame = pl.read_parquet(path)
            except Exception as e:
                raise ArtifactMismatch(f"{path}: unreadable vocabulary ({e})") from None
            if dict(frame.schema) != VOCAB_SCHEMA:
                raise ArtifactMismatch(f"{path}: vocabulary columns are {clip(dict(frame.schema))}, expected "
                                       f"{VOCAB_SCHEMA}")
            parts = frame.partition_by("column", as_dict=True, maintain_order=True)
            table_vocabs = []
            for c in spec.categorical:
                part = parts.get((c.name,))
                if part is None:
                    values = np.zeros(0, np.int64)
                    counts = np.zeros(0, np.int64)
                else:
                    part = part.sort("index")
                    values = part["value"].to_numpy().astype(np.int64)
                    counts = part["count"].to_numpy().astype(np.int64)
                    if not np.array_equal(part["index"].to_numpy(), np.arange(1, len(part) + 1)):
                        raise ArtifactMismatch(f"{path}: vocabulary of {c.name} has gaps in its indices")
                vocab = Vocabulary(c.name, values, counts)
                if sizes[table].get(c.name) != vocab.size:
                    raise ArtifactMismatch(
                        f"{path}: vocabulary of {c.name} has {vocab.size} rows, {stats_path.name} says "
                        f"{sizes[table].get(c.name)}"
                    )
                table_vocabs.append(vocab)
            vocabs[table] = table_vocabs
        return cls(config, continuous, vocabs)
