"""FeatureCore: O(1) gathers agree with the naive per-request Polars path; errors; history counts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from recpipe.bench._naive_features import NaiveFeatures
from recpipe.bench.features import check_same
from recpipe.errors import ArtifactMismatch, BadRequest, UnknownUser
from recpipe.features import history as hist
from recpipe.features.core import FeatureCore, read_tables
from recpipe.repository import Repository
from recpipe.timesplit import split_by_time


@pytest.fixture(scope="module")
def core(small_models: Path, small_dataset: Path) -> FeatureCore:
    return FeatureCore.load(small_models, small_dataset)


@pytest.fixture(scope="module")
def tables(small_dataset: Path) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    users, items, interactions = read_tables(small_dataset)
    return users, items, split_by_time(interactions)[0]


def test_shapes_match_the_repository(core: FeatureCore, small_models: Path) -> None:
    shapes = Repository.open(small_models).section("shapes")
    assert core.num_users == shapes["num_users"] and core.num_items == shapes["num_items"]
    u = core.augment_user(0)
    assert u.dense.shape == (core.user_dense_dim,) and u.dense.dtype == np.float32
    assert u.sparse.shape == (44,) and u.sparse.dtype == np.int64
    assert u.recent_items.shape == (core.history_len,) and u.recent_items.dtype == np.int64
    items = core.augment_items(0, np.array([0, 1, core.num_items - 1]))
    assert items.dense.shape == (3, core.item_dense_dim) and items.dense.dtype == np.float32
    assert items.sparse.shape == (3, 16) and items.sparse.dtype == np.int64
    assert core.item_dense_dim == shapes["item_dense_dim"] == 20 + 2 + len(hist.CROSS_FEATURES)


def test_gathers_equal_the_naive_polars_path(core: FeatureCore, tables) -> None:
    """Serving path (gathers) == filtering the raw tables per request and encoding them."""
    naive = NaiveFeatures(core, *tables)
    rng = np.random.default_rng(0)
    active = tables[2]["user_id"].unique().to_numpy()
    for user_id in [*rng.choice(active, 4, replace=False).tolist(), int(core.num_users - 1)]:
        check_same(core.augment_user(user_id), naive.augment_user(user_id))
        ids = rng.choice(core.num_items, 50, replace=False)
        check_same(core.augment_items(user_id, ids), naive.augment_items(user_id, ids))


def test_recent_items_are_the_latest_clicks(core: FeatureCore, tables) -> None:
    train = tables[2]
    user_id = int(train.filter(pl.col("label") == 1)["user_id"].mode()[0])
    clicks = train.filter((pl.col("user_id") == user_id) & (pl.col("label") == 1))["item_id"].to_numpy()
    recent = core.augment_user(user_id).recent_items
    expect = clicks[::-1][: core.history_len]
    np.testing.assert_array_equal(recent[: len(expect)], expect)
    assert (recent[len(expect) :] == -1).all()


def test_training_counts_are_strictly_earlier(core: FeatureCore, tables) -> None:
    train = tables[2]
    counts = core.training_counts(train)
    users = train["user_id"].to_numpy()
    labels = train["label"].to_numpy().astype(np.int64)
    for row in (0, len(users) // 2, len(users) - 1):
        earlier = users[:row] == users[row]
        assert counts.user_impressions[row] == earlier.sum()
        assert counts.user_clicks[row] == labels[:row][earlier].sum()
    # the last row of each user, plus its own interaction, gives the serving counts
    last = train.with_row_index("r").group_by("user_id").agg(pl.col("r").max())["r"].to_numpy()
    u = users[last]
    np.testing.assert_array_equal(counts.user_impressions[last] + 1, core.history.user_impressions[u])
    np.testing.assert_array_equal(counts.user_clicks[last] + labels[last], core.history.user_clicks[u])


def test_unknown_user_and_bad_items(core: FeatureCore) -> None:
    for bad in (-1, core.num_users, 10**12):
        with pytest.raises(UnknownUser):
            core.augment_user(bad)
        with pytest.raises(UnknownUser):
            core.augment_items(bad, np.array([0]))
    with pytest.raises(BadRequest):
        core.augment_user("3")  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="out of range"):
        core.augment_items(0, np.array([0, core.num_items]))
    with pytest.raises(BadRequest, match="out of range"):
        core.augment_items(0, np.array([-1]))
    with pytest.raises(BadRequest, match="1-D"):
        core.augment_items(0, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(BadRequest, match="integers"):
        core.augment_items(0, np.array([0.5]))
    with pytest.raises(BadRequest, match=r"expected 1\.\.10000 ids, got 0"):
        core.augment_items(0, np.zeros(0, dtype=np.int64))


def test_returned_arrays_do_not_alias_the_tables(core: FeatureCore) -> None:
    u = core.augment_user(1)
    u.dense[:] = 123.0
    assert not np.any(core.augment_user(1).dense == 123.0)


def test_other_dataset_is_rejected(small_models: Path, small_dataset: Path, tmp_path: Path) -> None:
    other = tmp_path / "data"
    shutil.copytree(small_dataset, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["dataset_sha256"] = "0" * 64
    manifest["sha256"] = {k: "0" * 64 for k in manifest["sha256"]}
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactMismatch, match=r"manifest\.json"):
        FeatureCore.load(small_models, other)


def test_changed_data_file_is_rejected(small_models: Path, small_dataset: Path, tmp_path: Path) -> None:
    other = tmp_path / "data"
    shutil.copytree(small_dataset, other)
    users = pl.read_parquet(other / "users.parquet")
    users.with_columns(pl.col("u_cont_00") + 1).write_parquet(other / "users.parquet")
    with pytest.raises(ArtifactMismatch, match=r"users\.parquet"):
        FeatureCore.load(small_models, other)


def test_a_batch_of_item_requests_gathers_what_each_gathers_alone(core) -> None:
    from recpipe.features.contract import ItemsQuery

    rng = np.random.default_rng(2)
    queries = [ItemsQuery.checked(u, rng.choice(core.num_items, k, replace=False), core.limits)
               for u, k in ((0, 5), (7, 1), (3, 30))]
    for q, got in zip(queries, core.items_batch(queries), strict=True):
        alone = core.items_batch([q])[0]
        np.testing.assert_array_equal(got.item_ids, alone.item_ids)
        np.testing.assert_array_equal(got.dense, alone.dense)
        np.testing.assert_array_equal(got.sparse, alone.sparse)
