"""Preprocessing: categorify, normalize, fill-missing; artifacts round-trip; one encoding path."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from recpipe import schema
from recpipe.errors import ArtifactMismatch
from recpipe.preprocess import PreprocessConfig, Preprocessor
from recpipe.preprocess.encoders import STATS_FILE, vocab_file


def random_table(table: schema.Table, n: int, seed: int) -> pl.DataFrame:
    """A schema-shaped frame: skewed categoricals (small ids frequent), some nulls, heavy tails."""
    rng = np.random.default_rng(seed)
    cols: dict[str, object] = {}
    for c in table.columns:
        if c.kind is schema.Kind.ID:
            cols[c.name] = np.arange(n, dtype=np.int64)
        elif c.kind is schema.Kind.CATEGORICAL:
            card = min(c.cardinality, 500)
            cols[c.name] = (np.minimum(rng.zipf(1.5, n) - 1, card - 1)).astype(np.int32)
        else:
            x = rng.lognormal(2.0, 1.5, n) if c.heavy_tailed else rng.normal(3.0, 2.0, n)
            values = x.astype(np.float32).tolist()
            for i in np.flatnonzero(rng.random(n) < max(c.null_rate, 0.02)):
                values[i] = None
            cols[c.name] = pl.Series(c.name, values, dtype=pl.Float32)
    return pl.DataFrame(cols)


@pytest.fixture(scope="module")
def tables() -> tuple[pl.DataFrame, pl.DataFrame]:
    return random_table(schema.USERS, 600, 1), random_table(schema.ITEMS, 900, 2)


@pytest.fixture(scope="module")
def prep(tables: tuple[pl.DataFrame, pl.DataFrame]) -> Preprocessor:
    users, items = tables
    return Preprocessor.fit(users, items, PreprocessConfig(max_vocab=50))


def test_categorify_is_frequency_ordered_with_unseen_bucket(prep: Preprocessor, tables) -> None:
    users, _ = tables
    col = "u_cat_04"
    counts = users[col].value_counts().sort(["count", col], descending=[True, False])
    vocab = prep.vocabs["users"][[v.name for v in prep.vocabs["users"]].index(col)]
    assert vocab.values[:5].tolist() == counts[col][:5].to_list()
    assert (np.diff(vocab.counts) <= 0).all()
    probe = pl.DataFrame({**{c.name: [None] * 3 for c in schema.USERS.columns}}).with_columns(
        pl.Series(col, [int(vocab.values[0]), 10_000_000, None], dtype=pl.Int32)
    )
    enc = prep.encode("users", probe)
    j = prep.sparse_names("users").index(col)
    assert enc.sparse[:, j].tolist() == [1, 0, 0]  # most frequent -> 1, unseen -> 0, null -> 0


def test_vocabulary_is_capped(prep: Preprocessor, tables) -> None:
    users, _ = tables
    sizes = prep.table_sizes("users")
    assert max(sizes) <= 50
    enc = prep.encode("users", users)
    assert (enc.sparse < np.asarray(sizes)).all() and (enc.sparse >= 0).all()
    # a column with more than 49 distinct values sends its tail to bucket 0
    j = prep.sparse_names("users").index("u_cat_04")
    assert users["u_cat_04"].n_unique() > 49 and (enc.sparse[:, j] == 0).any()


def test_normalize_log1p_and_fill_missing(prep: Preprocessor, tables) -> None:
    users, _ = tables
    enc = prep.encode("users", users)
    assert enc.dense.dtype == np.float32 and enc.dense.shape == (users.height, 40)
    assert np.isfinite(enc.dense).all()
    heavy = [i for i, c in enumerate(schema.USER_CONTINUOUS) if c.heavy_tailed]
    assert heavy
    for i in heavy:
        raw = users[schema.USER_CONTINUOUS[i].name]
        mask = raw.is_not_null().to_numpy()
        expected = np.log1p(raw.to_numpy()[mask].astype(np.float64))
        expected = (expected - expected.mean()) / expected.std(ddof=1)
        np.testing.assert_allclose(enc.dense[mask, i], expected, atol=1e-4)
        np.testing.assert_array_equal(enc.dense[~mask, i], 0.0)  # missing -> the mean
    assert abs(float(enc.dense[:, 0].mean())) < 0.05
    assert math.isclose(float(enc.dense[users["u_cont_00"].is_not_null().to_numpy(), 0].std()), 1.0, rel_tol=0.05)


def test_artifacts_round_trip(prep: Preprocessor, tables, tmp_path: Path) -> None:
    users, items = tables
    prep.save(tmp_path)
    loaded = Preprocessor.load(
        tmp_path / STATS_FILE, {t: tmp_path / vocab_file(t) for t in ("users", "items")}
    )
    for table, frame in (("users", users), ("items", items)):
        a, b = prep.encode(table, frame), loaded.encode(table, frame)
        np.testing.assert_array_equal(a.dense, b.dense)
        np.testing.assert_array_equal(a.sparse, b.sparse)
    assert loaded.table_sizes("items") == prep.table_sizes("items")


def test_row_by_row_encoding_equals_whole_table(prep: Preprocessor, tables) -> None:
    """The per-request (filter one row, encode) and bulk (encode all, gather) paths agree exactly."""
    _, items = tables
    whole = prep.encode("items", items)
    for item_id in (0, 17, 899):
        one = prep.encode("items", items.filter(pl.col("item_id") == item_id))
        np.testing.assert_array_equal(one.dense[0], whole.dense[item_id])
        np.testing.assert_array_equal(one.sparse[0], whole.sparse[item_id])


def test_corrupt_vocabulary_is_an_artifact_mismatch(prep: Preprocessor, tmp_path: Path) -> None:
    prep.save(tmp_path)
    (tmp_path / vocab_file("items")).write_bytes(b"not parquet")
    with pytest.raises(ArtifactMismatch, match=vocab_file("items")):
        Preprocessor.load(tmp_path / STATS_FILE, {t: tmp_path / vocab_file(t) for t in ("users", "items")})


def test_vocabulary_size_disagreeing_with_stats_names_the_file(prep: Preprocessor, tmp_path: Path) -> None:
    prep.save(tmp_path)
    path = tmp_path / vocab_file("users")
    frame = pl.read_parquet(path)
    frame.filter(~((pl.col("column") == "u_cat_04") & (pl.col("index") == pl.col("index").max().over("column"))))\
        .write_parquet(path)
    with pytest.raises(ArtifactMismatch, match="u_cat_04"):
        Preprocessor.load(tmp_path / STATS_FILE, {t: tmp_path / vocab_file(t) for t in ("users", "items")})
