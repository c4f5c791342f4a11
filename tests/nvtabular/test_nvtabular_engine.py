"""The NVTabular preprocessing engine against the Polars one, and a repository it trained, served.

The NVTabular fit runs in its own environment (``.ci/nvtabular-env.sh DIR``); the tests that need it
run when ``RECPIPE_NVTABULAR_PYTHON`` names that environment's interpreter (CI sets it) and are
skipped otherwise. The error paths run everywhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from recpipe.cli import main
from recpipe.errors import UsageError
from recpipe.features.core import read_tables
from recpipe.preprocess import PreprocessConfig, Preprocessor
from recpipe.preprocess import nvtabular_engine as engine
from recpipe.timesplit import split_by_time
from recpipe.training.config import TrainConfig

NVT_PYTHON = os.environ.get(engine.ENV_VAR)
needs_nvtabular = pytest.mark.skipif(
    not NVT_PYTHON, reason=f"{engine.ENV_VAR} is not set (create the env with .ci/nvtabular-env.sh DIR)"
)


def training_rows(data: Path) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """users, items, and their rows in the training split (as `recpipe train` selects them)."""
    users, items, interactions = read_tables(data)
    train, _ = split_by_time(interactions)
    return (
        users,
        items,
        users.filter(pl.col("user_id").is_in(train["user_id"].unique().implode())),
        items.filter(pl.col("item_id").is_in(train["item_id"].unique().implode())),
    )


def assert_same_encoding(polars_prep: Preprocessor, nvt_prep: Preprocessor, frames: dict[str, pl.DataFrame]) -> None:
    for table, frame in frames.items():
        for a, b in zip(polars_prep.vocabs[table], nvt_prep.vocabs[table], strict=True):
            assert a.name == b.name
            np.testing.assert_array_equal(a.values, b.values, err_msg=f"vocabulary of {a.name}")
            np.testing.assert_array_equal(a.counts, b.counts, err_msg=f"counts of {a.name}")
        for a, b in zip(polars_prep.continuous[table], nvt_prep.continuous[table], strict=True):
            assert (a.name, a.log1p) == (b.name, b.log1p)
            assert b.mean == pytest.approx(a.mean, rel=1e-6, abs=1e-6), a.name
            assert b.std == pytest.approx(a.std, rel=1e-5), a.name
        # every row of the table, the ones outside the training split included (unseen values -> 0)
        pe, ne = polars_prep.encode(table, frame), nvt_prep.encode(table, frame)
        np.testing.assert_array_equal(pe.sparse, ne.sparse)
        np.testing.assert_allclose(ne.dense, pe.dense, rtol=0, atol=1e-5)


@needs_nvtabular
def test_capped_vocabularies_and_ties_match_polars(small_dataset: Path) -> None:
    """A cap of 6 binds on most columns, with ties at the cut: both engines keep the same values."""
    users, items, train_users, train_items = training_rows(small_dataset)
    config = PreprocessConfig(max_vocab=6)
    nvt_prep = engine.fit(train_users, train_items, config, python=NVT_PYTHON)
    polars_prep = Preprocessor.fit(train_users, train_items, config)
    assert_same_encoding(polars_prep, nvt_prep, {"users": users, "items": items})
    capped = [v for v in nvt_prep.vocabs["users"] if v.size == 6]
    assert len(capped) > 20
    # ties at the cut exist, so the tie-break (value ascending) is really exercised
    polars_full = Preprocessor.fit(train_users, train_items, PreprocessConfig())
    tied = sum(
        int(full.counts[4] == full.counts[5])
        for full in polars_full.vocabs["users"] + polars_full.vocabs["items"]
        if full.size > 6
    )
    assert tied > 0
    assert 0 in nvt_prep.encode("users", users).sparse  # beyond the cap -> bucket 0


@pytest.fixture(scope="module")
def nvt_models(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nvt-models") / "models"
    rc = main(["train", "--data", str(small_dataset), "--out", str(out), "--epochs", "1", "--index", "flat",
               "--preprocess", "nvtabular", "--nvtabular-python", str(NVT_PYTHON), "--quiet"])
    assert rc == 0
    return out


@needs_nvtabular
def test_train_with_nvtabular_writes_the_polars_encoding(nvt_models: Path, small_dataset: Path) -> None:
    users, items, train_users, train_items = training_rows(small_dataset)
    exported = engine.load_exported(nvt_models / "preprocess", PreprocessConfig(TrainConfig.max_vocab))
    polars_prep = Preprocessor.fit(train_users, train_items, PreprocessConfig(TrainConfig.max_vocab))
    assert_same_encoding(polars_prep, exported, {"users": users, "items": items})
    assert not list((nvt_models / "preprocess").glob("*.pkl"))


@needs_nvtabular
def test_repository_trained_with_nvtabular_serves(nvt_models: Path, small_dataset: Path) -> None:
    from recpipe.client import RecommendClient
    from recpipe.inprocess import start_chain
    from recpipe.serving.server import ServerThread

    with ServerThread() as threads:
        chain = start_chain(threads, nvt_models, small_dataset, device="cpu")
        with RecommendClient(chain.gateway.address) as client:
            rec = client.recommend(user_id=0, num_candidates=50, num_results=10)
    assert len(rec.item_ids) == 10
    assert len(set(rec.item_ids.tolist())) == 10
    assert np.all(np.diff(rec.scores) <= 0)


def test_missing_environment_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(engine.ENV_VAR, raising=False)
    out = tmp_path / "models"
    rc = main(["train", "--data", str(tmp_path), "--out", str(out), "--preprocess", "nvtabular"])
    assert rc == 2
    err = capsys.readouterr().err
    assert engine.ENV_VAR in err and "nvtabular-env.sh" in err
    assert not out.exists()

    rc = main(["train", "--data", str(tmp_path), "--out", str(out), "--preprocess", "nvtabular",
               "--nvtabular-python", str(tmp_path / "no-such-python")])
    assert rc == 2
    assert "not an executable Python interpreter" in capsys.readouterr().err


def test_interpreter_without_nvtabular_is_a_usage_error(small_dataset: Path) -> None:
    """The serving interpreter itself has no NVTabular: the exporter's import error becomes a UsageError."""
    _, _, train_users, train_items = training_rows(small_dataset)
    with pytest.raises(UsageError, match="not a working NVTabular environment"):
        engine.fit(train_users.head(50), train_items.head(50), python=sys.executable)


@needs_nvtabular
def test_exporter_never_overwrites_without_force(tmp_path: Path) -> None:
    (tmp_path / "stats.json").write_text("{}")
    rows = tmp_path / "rows.parquet"
    with pytest.raises(UsageError, match=r"already holds stats\.json"):
        engine.run_exporter(Path(str(NVT_PYTHON)), tmp_path, PreprocessConfig(), users=rows, items=rows)
    assert (tmp_path / "stats.json").read_text() == "{}"
