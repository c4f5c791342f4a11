"""`recpipe synth-data` / recpipe.datagen: contract, determinism, errors, planted structure."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recpipe import schema
from recpipe.cli import main
from recpipe.datagen import DatagenConfig, generate, load_manifest, verify
from recpipe.datagen import features as features_module
from recpipe.errors import ArtifactMismatch, UsageError

SCALE = 0.01
SEED = 7
FILES = ("users.parquet", "items.parquet", "interactions.parquet", "manifest.json")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("datagen") / "data"
    assert main(["synth-data", "--out", str(out), "--scale", str(SCALE), "--seed", str(SEED), "--quiet"]) == 0
    return out, json.loads((out / "manifest.json").read_text())


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# --- contract ----------------------------------------------------------------------------------

@pytest.mark.parametrize("table", schema.TABLES, ids=lambda t: t.name)
def test_files_match_the_schema(dataset: tuple[Path, dict[str, Any]], table: schema.Table) -> None:
    out, _ = dataset
    data = pq.read_table(out / schema.TABLE_FILES[table.name])
    assert data.column_names == table.column_names
    assert [f.type for f in data.schema] == [pa.from_numpy_dtype(c.dtype) for c in table.columns]
    assert data.num_rows == table.rows_at(SCALE)
    for c in table.categorical:
        values = data[c.name].to_numpy()
        card = c.cardinality_at(SCALE)
        assert values.min() >= 0 and values.max() < card, c.name
        if card <= 50:  # small vocabularies are used in full, not squeezed into a few values
            assert np.unique(values).shape[0] == card, c.name
    for c in table.of_kind(schema.Kind.ID):
        assert data[c.name].null_count == 0


def test_ids_and_time_order(dataset: tuple[Path, dict[str, Any]]) -> None:
    out, _ = dataset
    users = pq.read_table(out / "users.parquet", columns=["user_id"])["user_id"].to_numpy()
    items = pq.read_table(out / "items.parquet", columns=["item_id"])["item_id"].to_numpy()
    np.testing.assert_array_equal(users, np.arange(users.shape[0]))
    np.testing.assert_array_equal(items, np.arange(items.shape[0]))
    inter = pq.read_table(out / "interactions.parquet")
    ts = inter["timestamp"].to_numpy()
    assert np.all(np.diff(ts) >= 0)
    assert ts[-1] - ts[0] > 80 * 86_400  # about 90 days
    assert set(np.unique(inter["label"].to_numpy()).tolist()) == {0, 1}
    assert inter["user_id"].to_numpy().max() < users.shape[0]
    assert inter["item_id"].to_numpy().max() < items.shape[0]


def test_rows_scale_linearly(tmp_path: Path) -> None:
    m = generate(DatagenConfig(scale=0.002, seed=1), tmp_path / "d")
    assert m["rows"] == {"users": 442, "items": 1700, "interactions": 8000}
    assert pq.read_metadata(tmp_path / "d" / "interactions.parquet").num_rows == 8000


def test_nulls_and_heavy_tails(dataset: tuple[Path, dict[str, Any]]) -> None:
    out, _ = dataset
    for table in (schema.USERS, schema.ITEMS):
        data = pq.read_table(out / schema.TABLE_FILES[table.name])
        for c in table.continuous:
            share = data[c.name].null_count / data.num_rows
            if c.null_rate == 0:
                assert share == 0, c.name
            else:
                assert 0.3 * c.null_rate <= share <= 2.5 * c.null_rate, (c.name, share)
    price = pq.read_table(out / "items.parquet", columns=["i_cont_00"])["i_cont_00"].drop_null().to_numpy()
    assert price.min() > 0 and np.quantile(price, 0.999) > 20 * np.median(price)


def test_manifest(dataset: tuple[Path, dict[str, Any]]) -> None:
    out, m = dataset
    assert m["schema_version"] == schema.SCHEMA_VERSION and m["seed"] == SEED and m["scale"] == SCALE
    assert m["rows"] == {t.name: t.rows_at(SCALE) for t in schema.TABLES}
    assert sorted(m["sha256"]) == sorted(FILES[:3])
    assert verify(out) == m == load_manifest(out)
    n = m["rows"]["interactions"]
    assert m["split"]["holdout_rows"] == round(n * schema.HOLDOUT_FRACTION)
    assert m["split"]["train_rows"] + m["split"]["holdout_rows"] == n
    ts = pq.read_table(out / "interactions.parquet", columns=["timestamp"])["timestamp"].to_numpy()
    assert m["split"]["holdout_start_timestamp"] == ts[m["split"]["train_rows"]]
    assert 0 < m["oracle"]["recall_at_500"] <= 1 and 0 < m["oracle"]["recall_users"] <= 1000
    assert m["cardinalities"]["items"]["i_cat_02"] == schema.ITEMS.column("i_cat_02").cardinality_at(SCALE)
    assert sorted(os.listdir(out)) == sorted(FILES)  # no temporary files left behind


# --- determinism -------------------------------------------------------------------------------

def test_same_seed_and_scale_give_identical_bytes(dataset: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out, _ = dataset
    generate(DatagenConfig(scale=SCALE, seed=SEED), tmp_path / "again")
    assert _snapshot(tmp_path / "again") == _snapshot(out)
    generate(DatagenConfig(scale=SCALE, seed=SEED + 1), tmp_path / "other")
    other = _snapshot(tmp_path / "other")
    assert all(other[f] != _snapshot(out)[f] for f in FILES)


# --- planted structure -------------------------------------------------------------------------

def test_planted_structure(dataset: tuple[Path, dict[str, Any]]) -> None:
    out, m = dataset
    assert 0.02 <= m["stats"]["click_rate"] <= 0.20
    assert m["stats"]["top1pct_item_share"] > 0.10
    assert 0.75 <= m["oracle"]["auc"] <= 0.90
    inter = pq.read_table(out / "interactions.parquet")
    label = inter["label"].to_numpy()
    item = inter["item_id"].to_numpy()
    counts = np.sort(np.bincount(item, minlength=m["rows"]["items"]))[::-1]
    assert counts[: max(1, counts.shape[0] // 100)].sum() / item.shape[0] == pytest.approx(
        m["stats"]["top1pct_item_share"])
    # heavy-tailed user activity: the busiest 10% of users make well over 10% of the interactions
    per_user = np.sort(np.bincount(inter["user_id"].to_numpy()))[::-1]
    assert per_user[: per_user.shape[0] // 10].sum() / label.shape[0] > 0.25


def test_label_follows_the_latent_score(dataset: tuple[Path, dict[str, Any]]) -> None:
    """Clicks follow u·v of the hidden world, and an observable feature (rating ~ quality) carries signal."""
    from recpipe.datagen.click_model import DEFAULT_MODEL
    from recpipe.datagen.generate import DAYS
    from recpipe.datagen.oracle import auc
    from recpipe.datagen.world import make_world

    out, _ = dataset
    world = make_world(DatagenConfig(scale=SCALE, seed=SEED), DEFAULT_MODEL, DAYS)
    inter = pq.read_table(out / "interactions.parquet")
    user, item, label = (inter[c].to_numpy() for c in ("user_id", "item_id", "label"))
    latent = np.einsum("ij,ij->i", world.users.u[user], world.items.v(0, world.items.n)[item])
    latent_auc = auc(latent, label)
    assert latent_auc is not None and latent_auc > 0.65
    rating = pq.read_table(out / "items.parquet", columns=["i_cont_02"])["i_cont_02"].to_numpy(zero_copy_only=False)
    r = np.nan_to_num(rating[item], nan=float(np.nanmean(rating)))
    rating_auc = auc(r, label)
    assert rating_auc is not None and rating_auc > 0.53
    # the user's preferred category is visible (u_cat_11) and clicked items come from it more often
    pref = pq.read_table(out / "users.parquet", columns=["u_cat_11"])["u_cat_11"].to_numpy()
    cat = pq.read_table(out / "items.parquet", columns=["i_cat_00"])["i_cat_00"].to_numpy()
    match = pref[user] == cat[item]
    assert label[match].mean() > label[~match].mean()


# --- errors ------------------------------------------------------------------------------------

def test_refuses_to_overwrite_without_force(dataset: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    out, _ = dataset
    before = _snapshot(out)
    assert main(["synth-data", "--out", str(out), "--scale", "0.001", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--force" in err[0]
    assert _snapshot(out) == before


def test_force_replaces_a_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d"
    assert main(["synth-data", "--out", str(out), "--scale", "0.001", "--seed", "1"]) == 0
    assert main(["synth-data", "--out", str(out), "--scale", "0.001", "--seed", "2", "--force"]) == 0
    assert load_manifest(out)["seed"] == 2
    assert sorted(os.listdir(tmp_path)) == ["d"]
    captured = capsys.readouterr()
    # Not a terminal: no progress bar on stderr, but the summary still reaches stdout (issue 14).
    assert captured.err == ""
    lines = captured.out.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"wrote {out}: 221 users, 850 items") for line in lines)
    assert main(["synth-data", "--out", str(out), "--scale", "0.001", "--seed", "3", "--force", "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("args", [
    ["--scale", "0"], ["--scale", "-1"], ["--scale", "nan"], ["--scale", "inf"], ["--scale", "x"],
    ["--scale", "1000"], ["--seed", "-1"], ["--seed", "1.5"], ["--seed", str(2**63)], ["--seed", "abc"],
])
def test_bad_arguments_are_one_line_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 args: list[str]) -> None:
    assert main(["synth-data", "--out", str(tmp_path / "d"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recpipe: error:")
    assert os.listdir(tmp_path) == []


def test_largest_seed_is_accepted() -> None:
    assert DatagenConfig(scale=0.001, seed=2**63 - 1).seed == 2**63 - 1
    with pytest.raises(UsageError):
        DatagenConfig(scale=0.001, seed=2**63)


@pytest.mark.parametrize("where", ["under_a_file", "is_a_file", "read_only_parent"])
def test_unwritable_destination(tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    if where == "under_a_file":
        out = blocker / "d"
    elif where == "is_a_file":
        out = blocker
    else:
        if os.geteuid() == 0:
            pytest.skip("root ignores directory permissions")
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        out = ro / "d"
    assert main(["synth-data", "--out", str(out), "--scale", "0.001"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert blocker.read_text() == "x"


def test_directory_with_foreign_files_is_never_replaced(tmp_path: Path) -> None:
    out = tmp_path / "d"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["synth-data", "--out", str(out), "--scale", "0.001", "--force", "--quiet"]) == 2
    assert os.listdir(out) == ["notes.txt"]


def _dir_named_like_a_table(out: Path) -> None:
    (out / "users.parquet").mkdir()
    (out / "users.parquet" / "notes.txt").write_text("mine")


def _symlink_named_like_a_table(out: Path) -> None:
    (out.parent / "target").write_text("mine")
    (out / "items.parquet").symlink_to(out.parent / "target")


def _own_parquet_without_manifest(out: Path) -> None:
    (out / "users.parquet").write_text("someone's own users table")


def _other_tools_manifest(out: Path) -> None:
    (out / "manifest.json").write_text('{"name": "my-app"}')


def _tree(d: Path) -> dict[str, object]:
    return {p.relative_to(d).as_posix(): (p.is_symlink(), p.read_bytes() if p.is_file() else None)
            for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("plant", [_dir_named_like_a_table, _symlink_named_like_a_table,
                                   _own_parquet_without_manifest, _other_tools_manifest])
def test_files_named_like_a_dataset_but_not_ours_survive_force(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                plant) -> None:
    # before: --force moved the directory aside and deleted it, with what the user kept there
    out = tmp_path / "d"
    out.mkdir()
    plant(out)
    before = _tree(tmp_path)
    assert main(["synth-data", "--out", str(out), "--scale", "0.001", "--force", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recpipe: error:")
    assert _tree(tmp_path) == before


def test_force_through_a_symlink_replaces_the_dataset_it_names_and_keeps_the_link(tmp_path: Path) -> None:
    # before: the link was renamed over and deleted, and the dataset it named was left as it was
    real = tmp_path / "disk" / "d"
    assert main(["synth-data", "--out", str(real), "--scale", "0.001", "--seed", "1", "--quiet"]) == 0
    link = tmp_path / "d"
    link.symlink_to(real)
    assert main(["synth-data", "--out", str(link), "--scale", "0.001", "--seed", "2", "--force", "--quiet"]) == 0
    assert link.is_symlink() and load_manifest(real)["seed"] == 2
    assert sorted(os.listdir(tmp_path)) == ["d", "disk"] and os.listdir(real.parent) == ["d"]


def test_missing_parents_are_created(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "d"
    assert main(["synth-data", "--out", str(out), "--scale", "0.001", "--quiet"]) == 0
    assert sorted(os.listdir(out)) == sorted(FILES)


def test_empty_directory_is_filled(tmp_path: Path) -> None:
    out = tmp_path / "d"
    out.mkdir()
    assert main(["synth-data", "--out", str(out), "--scale", "0.001", "--quiet"]) == 0
    verify(out)


def test_failed_run_leaves_old_dataset_and_no_temporaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "d"
    generate(DatagenConfig(scale=0.001, seed=1), out)
    before = _snapshot(out)
    calls = {"n": 0}

    def failing(*args: Any) -> Any:
        calls["n"] += 1
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C halfway

    monkeypatch.setattr(features_module, "item_block", failing)
    assert main(["synth-data", "--out", str(out), "--scale", "0.001", "--force", "--quiet"]) == 130
    assert calls["n"] == 1
    assert _snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == ["d"]
    fresh = tmp_path / "fresh"
    assert main(["synth-data", "--out", str(fresh), "--scale", "0.001", "--quiet"]) == 130
    assert sorted(os.listdir(tmp_path)) == ["d"]
    # nor the missing parents it made for --out
    assert main(["synth-data", "--out", str(tmp_path / "new" / "deeper" / "data"), "--scale", "0.001", "--quiet"]) == 130
    assert sorted(os.listdir(tmp_path)) == ["d"]


# --- manifest helpers --------------------------------------------------------------------------

def test_load_manifest_and_verify_name_the_broken_file(tmp_path: Path) -> None:
    out = tmp_path / "d"
    with pytest.raises(ArtifactMismatch, match=r"manifest\.json"):
        load_manifest(out)
    generate(DatagenConfig(scale=0.001, seed=3), out)
    data = out / "items.parquet"
    data.write_bytes(data.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(ArtifactMismatch, match=r"items\.parquet"):
        verify(out)
    verify(out, ["users.parquet"])
    data.unlink()
    with pytest.raises(ArtifactMismatch, match=r"items\.parquet.*missing"):
        verify(out)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactMismatch, match=r"manifest\.json"):
        load_manifest(out)
    (out / "manifest.json").write_text(json.dumps({"schema_version": 99, "seed": 0, "scale": 1, "rows": {},
                                                   "sha256": {}, "oracle": {}}))
    with pytest.raises(ArtifactMismatch, match="schema_version"):
        load_manifest(out)


def test_tiniest_scale_is_valid(tmp_path: Path) -> None:
    """One user, one item, four interactions, no held-out rows: an oracle of nulls, not a crash."""
    m = generate(DatagenConfig(scale=1e-6, seed=0), tmp_path / "d")
    assert m["rows"] == {"users": 1, "items": 1, "interactions": 4}
    assert m["split"]["holdout_rows"] == 0 and m["oracle"]["auc"] is None
    verify(tmp_path / "d")


def test_bench_runs_both_forms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "datagen", "--scale", "0.001", "--tmp", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "naive" in out and "synth-data" in out and "peak RSS" in out
    assert os.listdir(tmp_path) == []  # children's outputs are removed
    assert main(["bench", "datagen", "--scale", "0"]) == 2


def test_out_a_symlink_loop_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert main(["synth-data", "--out", str(tmp_path / "a"), "--scale", "0.001", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recpipe: error: ") and "symlink" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
