"""recpipe train end to end at tiny scale, its contract, its refusals; metrics and split helpers."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import pytest

from recpipe.cli import main
from recpipe.repository import Repository, read_json
from recpipe.timesplit import split_by_time
from recpipe.training.config import INDEX_CHOICES, TrainConfig
from recpipe.training.loops import sample_ranking_rows
from recpipe.training.metrics import auc, recall_at_k

if TYPE_CHECKING:
    from recpipe.datagen.world import World


def test_auc_matches_pairwise_definition() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 60)
    s = np.round(rng.random(60), 1)  # ties on purpose
    pairs = [(a, b) for a, b in itertools.product(range(60), range(60)) if y[a] == 1 and y[b] == 0]
    expect = sum(1.0 if s[a] > s[b] else 0.5 if s[a] == s[b] else 0.0 for a, b in pairs) / len(pairs)
    assert auc(y, s) == pytest.approx(expect)
    assert auc(np.ones(3), np.arange(3)) != auc(np.ones(3), np.arange(3))  # NaN: one class only


def test_recall_at_k() -> None:
    retrieved = np.array([[1, 2, 3], [4, 5, 6]])
    assert recall_at_k(retrieved, np.array([0, 0, 1]), np.array([3, 9, 4])) == pytest.approx(2 / 3)


def test_split_holds_out_the_latest_tenth() -> None:
    frame = pl.DataFrame({"user_id": range(100), "item_id": range(100), "label": [0] * 100,
                          "timestamp": list(range(100))[::-1]})
    train, hold = split_by_time(frame)
    assert hold.height == 10 and train.height == 90
    assert train["timestamp"].max() < hold["timestamp"].min()


def test_negative_sampling_keeps_positives_and_reweights() -> None:
    labels = np.array([1] * 100 + [0] * 2000)
    rows, weights = sample_ranking_rows(labels, TrainConfig(negatives_per_positive=3.0), np.random.default_rng(0))
    kept = labels[rows]
    assert (kept == 1).sum() == 100 and (kept == 0).sum() == 300
    # weighted, the kept negatives stand for all 2000
    assert weights[kept == 0].sum() == pytest.approx(2000, rel=1e-6)
    # under the row cap the negatives give way first: every positive stays
    capped = TrainConfig(negatives_per_positive=3.0, max_ranking_rows=250)
    rows, weights = sample_ranking_rows(labels, capped, np.random.default_rng(0))
    kept = labels[rows]
    assert (kept == 1).sum() == 100 and (kept == 0).sum() == 150
    assert weights[kept == 0].sum() == pytest.approx(2000, rel=1e-6)
    # positives alone over the cap: they are subsampled, and no negative fits
    rows, weights = sample_ranking_rows(labels, TrainConfig(max_ranking_rows=60), np.random.default_rng(0))
    assert len(rows) == 60 and (labels[rows] == 1).all()


def test_repository_contract(small_models: Path, small_dataset: Path) -> None:
    manifest = Repository.open(small_models).manifest
    data_manifest = read_json(small_dataset / "manifest.json")
    for key in ("dataset_sha256", "created_at", "versions", "metrics", "version", "files", "shapes"):
        assert key in manifest
    assert {"recpipe", "torch", "faiss"} <= set(manifest["versions"])
    m = manifest["metrics"]
    for key in ("ranking_auc", "oracle_auc", "retrieval_recall_at_500", "popularity_recall_at_500",
                "index_recall_at_100", "index_type"):
        assert key in m
    assert m["oracle_auc"] == data_manifest["oracle"]["auc"]
    assert 0.5 < m["ranking_auc"] <= 1.0
    assert 0.0 <= m["popularity_recall_at_500"] <= 1.0 and 0.0 < m["retrieval_recall_at_500"] <= 1.0
    assert m["index_recall_at_100"] >= 0.95
    # any kind auto may pick: it times them, so under load a different one can win
    assert m["index_type"] in INDEX_CHOICES and m["index_type"] != "auto"
    # the DLRM's epoch choice and its precisions (--epochs 1: one epoch run, and chosen)
    assert (m["ranking_epoch"], m["ranking_epochs_run"], m["ranking_interaction"]) == (1, 1, "dot")
    # no validation split by default: every training row trains it, so there is no validation AUC
    assert 0.5 < m["ranking_train_auc"] <= 1.0 and m["ranking_val_auc"] is None
    by_precision = m["ranking_auc_by_precision"]
    assert {"fp32", "int8"} <= set(by_precision)
    assert abs(by_precision["fp32"] - m["ranking_auc"]) < 1e-3  # the served forward scores what the model does
    training = manifest["training"]
    assert {"dlrm", "ranking_eval", "precision_eval", "total"} <= set(training["seconds"])
    assert [h["epoch"] for h in training["dlrm"]["history"]] == [1]


def test_dlrm_keeps_the_best_validation_epoch_or_else_the_last(noise_rows: Any) -> None:
    import torch

    from recpipe.training import loops
    from recpipe.training.config import TrainConfig

    n = 3000
    core, users, items, labels, counts = noise_rows(n, 3)  # pure noise: any epoch after the first only memorises it
    cfg = TrainConfig(epochs=6, min_steps=20, ranking_embedding_lr=2e-2, ranking_lr=2e-2, ranking_val_fraction=0.1)
    model, stats = loops.train_dlrm(core, users, items, labels, counts, cfg, torch.device("cpu"))
    history = stats["history"]
    vals = [h["val_auc"] for h in history]
    assert stats["val_rows"] == n // 10 and 1 <= stats["epoch"] <= stats["epochs_run"] <= 6
    assert vals[stats["epoch"] - 1] == max(vals)  # the kept epoch is the best one seen
    if stats["epochs_run"] < 6:  # stopped early: right after an epoch that did not improve
        assert stats["epochs_run"] == stats["epoch"] + 1
    val = np.arange(n - n // 10, n)
    again = loops.score_dlrm(model, core, users[val], items[val], torch.device("cpu"), counts=counts.take(val))
    assert round(auc(labels[val], again), 5) == history[stats["epoch"] - 1]["val_auc"]  # its weights, restored
    # without a validation split (the default) every planned epoch runs on every row and the last is kept,
    # although on these noise labels the later epochs only memorise
    cfg = TrainConfig(epochs=3, min_steps=20, ranking_embedding_lr=2e-2, ranking_lr=2e-2)
    _, stats = loops.train_dlrm(core, users, items, labels, counts, cfg, torch.device("cpu"))
    assert (stats["val_rows"], stats["epoch"], stats["epochs_run"], stats["val_auc"]) == (0, 3, 3, None)
    assert [h["val_auc"] for h in stats["history"]] == [None] * 3
    # the validation share by interaction when none is given: DCN's cross layers memorise, so it stops early
    assert (cfg.val_fraction, TrainConfig(interaction="dcn").val_fraction) == (0.0, 0.1)
    assert (TrainConfig().ranking_epochs, TrainConfig(interaction="dcn").ranking_epochs) == (8, 4)
    assert TrainConfig(interaction="dcn", ranking_val_fraction=0.0).val_fraction == 0.0


def test_dlrm_tables_fixed_by_default_train_as_the_plain_forward_would(noise_rows: Any, monkeypatch) -> None:
    """Two training runs, one through the fixed-table forward and one through the model's, end with the
    same weights: in float32 (``ranking_bf16=False``), the same path on every machine.

    By default a CPU with native bf16 (AVX512-BF16 / AMX, read from /proc/cpuinfo, so
    ``ATEN_CPU_CAPABILITY=avx2`` does not change it) trains under bf16 autocast, which rounds every
    product to 8 bits: two equal computations ordered differently then part within a few Adam steps,
    and a weight-for-weight comparison says nothing about the forward. Measured on such a CPU (2
    epochs, 20 steps): in bf16 the two runs' weights ended 0.13 apart (scale 0.54); the model's own
    forward, trained once with oneDNN's bf16 kernels and once with them held to AVX2
    (``DNNL_MAX_CPU_ISA``), ended 0.028 apart from itself; one step on the same weights was as far
    from float64 through either forward (the worst gradient 7.6e-2 and 7.4e-2 relative). In float32
    the two runs ended 6.5e-7 apart, and holding every kernel library to AVX2 (``ATEN_CPU_CAPABILITY``,
    ``DNNL_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``) changed no weight by a bit. The bf16 step is
    checked against float64 in tests/unit/test_training_fixed_tables.py."""
    import torch

    from recpipe.ranking.model import DLRM
    from recpipe.training import fixed_tables, loops
    from recpipe.training.config import TrainConfig

    n = 2000
    core, users, items, labels, counts = noise_rows(n, 4)
    cfg = TrainConfig(epochs=2, min_steps=10, ranking_bf16=False)
    assert cfg.ranking_embedding_lr == 0.0
    torch.manual_seed(cfg.seed)
    start = DLRM(loops.dlrm_config(core, cfg)).sparse_arch.tables.weight.detach().clone()
    fast, stats = loops.train_dlrm(core, users, items, labels, counts, cfg, torch.device("cpu"))
    assert stats["tables_learn"] is False
    table = fast.sparse_arch.tables.weight
    assert table.requires_grad  # put back for whoever fine-tunes the model next
    # the tables keep their start: every table's rows as drawn, but the zeroed and exposure-initialised ones
    names = core.preprocessor.sparse_names("users") + core.preprocessor.sparse_names("items")
    offsets = [*fast.sparse_arch.tables.offsets.tolist(), table.shape[0]]
    changed = set(stats["frozen_tables"]) | {stats["exposure_table"]}
    kept = [t for t, name in enumerate(names) if name not in changed]
    assert kept
    for t in kept:
        assert torch.equal(table[offsets[t] : offsets[t + 1]], start[offsets[t] : offsets[t + 1]]), names[t]
    # the same training through the model's own forward (the table-table dots' backward included)
    monkeypatch.setattr(fixed_tables, "applies", lambda model: False)
    plain, again = loops.train_dlrm(core, users, items, labels, counts, cfg, torch.device("cpu"))
    assert again["tables_learn"] is False
    for (name, a), (_, b) in zip(fast.state_dict().items(), plain.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert [h["loss"] for h in stats["history"]] == pytest.approx([h["loss"] for h in again["history"]], abs=1e-4)


def test_the_dlrm_gets_a_wide_part_over_the_signal_columns(noise_rows: Any) -> None:
    import torch

    from recpipe import schema
    from recpipe.training import loops
    from recpipe.training.config import TrainConfig

    core, users, items, labels, counts = noise_rows(2000, 6)
    cfg = TrainConfig(epochs=1, min_steps=10)
    config = loops.dlrm_config(core, cfg)
    p = core.preprocessor
    assert config.wide_table is not None
    assert (p.sparse_names("users") + p.sparse_names("items"))[config.wide_table] == "i_cat_00"
    for table, spec, (start, stop) in (("users", schema.USERS, config.wide_user_columns),
                                       ("items", schema.ITEMS, config.wide_item_columns)):
        names = p.dense_names(table)
        inside = {spec.column(n).meaning for n in names[start:stop]}
        outside = {spec.column(n).meaning for n in names[:start] + names[stop:]}
        assert stop - start > 1 and len(inside) == 1 and inside.pop().startswith("latent"), (table, start, stop)
        assert not any(m.startswith("latent") for m in outside)
    assert loops.dlrm_config(core, dataclasses.replace(cfg, ranking_wide=False)).wide_table is None
    model, stats = loops.train_dlrm(core, users, items, labels, counts, cfg, torch.device("cpu"))
    assert stats["wide_table"] == "i_cat_00" and model.wide is not None
    # it starts at zero and learns (its table term too, unless the leaf table is too sparse here and zero)
    learnt = {name for name, w in model.wide.named_parameters() if w.abs().sum() > 0}
    assert {"user_item.weight", "user_linear.weight", "user_linear.bias", "item_linear.weight"} <= learnt, learnt
    assert ("user_table.weight" in learnt) == ("i_cat_00" not in stats["frozen_tables"])
    _, off = loops.train_dlrm(core, users, items, labels, counts, dataclasses.replace(cfg, ranking_wide=False),
                              torch.device("cpu"))
    assert off["wide_table"] is None


def test_dlrm_steps_run_in_bf16_where_the_config_or_else_the_cpu_says(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from recpipe.ranking import precision
    from recpipe.training import loops

    cpu = torch.device("cpu")

    def bf16(choice: bool | None) -> bool:
        with loops.dlrm_autocast(cpu, choice):
            return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16

    for native in (True, False):
        monkeypatch.setattr(precision, "native_bf16", lambda flags=None, native=native: native)
        assert bf16(None) is native  # the default follows the CPU
        assert bf16(True) and not bf16(False)  # the config forces either path on any CPU
    assert not torch.is_autocast_enabled("cpu")
    assert TrainConfig().ranking_bf16 is None


def test_dlrm_epochs_draw_their_own_negatives_where_the_cap_leaves_some_out(noise_rows: Any) -> None:
    import torch

    from recpipe.training import loops
    from recpipe.training.config import TrainConfig

    n = 2000
    core, users, items, labels, counts = noise_rows(n, 5)
    positives = int(labels.sum())
    cpu = torch.device("cpu")
    # the cap keeps every positive and 200 of the ~1,400 negatives an epoch
    capped = TrainConfig(epochs=3, min_steps=10, max_ranking_rows=positives + 200)
    assert capped.ranking_fresh_negatives
    _, fresh = loops.train_dlrm(core, users, items, labels, counts, capped, cpu)
    per_epoch = positives + 200
    assert fresh["rows"] == 3 * per_epoch
    # three draws of 200 from ~1,400: about 520 distinct negatives, against 200 drawn once
    assert per_epoch + 200 < fresh["rows_distinct"] <= positives + 600
    _, same = loops.train_dlrm(core, users, items, labels, counts,
                               dataclasses.replace(capped, ranking_fresh_negatives=False), cpu)
    assert same["rows_distinct"] == per_epoch
    # where every row fits, each epoch's draw is every row: the run is the one without fresh draws
    full = TrainConfig(epochs=2, min_steps=10)
    a, a_stats = loops.train_dlrm(core, users, items, labels, counts, full, cpu)
    b, _ = loops.train_dlrm(core, users, items, labels, counts,
                            dataclasses.replace(full, ranking_fresh_negatives=False), cpu)
    assert a_stats["rows_distinct"] == n
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_refuses_to_overwrite_without_force(small_models: Path, small_dataset: Path, capsys) -> None:
    before = (small_models / "manifest.json").read_bytes()
    assert main(["train", "--data", str(small_dataset), "--out", str(small_models), "--quiet"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (small_models / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("args", [["--epochs", "0"], ["--seed", "-1"], ["--index", "lsh"], ["--device", "tpu"],
                                  ["--threads", "-1"], ["--val-fraction", "0.5"], ["--val-fraction", "-0.1"],
                                  # before: an OverflowError traceback from FAISS's k-means seed after
                                  # training, one from torch.manual_seed, and a segfault of torch's pool
                                  ["--seed", str(2**31)], ["--seed", str(10**20)], ["--threads", "100000"]])
def test_bad_arguments_exit_2(args: list[str], small_dataset: Path, tmp_path: Path, capsys) -> None:
    assert main(["train", "--data", str(small_dataset), "--out", str(tmp_path / "m"), "--quiet", *args]) == 2
    assert not (tmp_path / "m").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recpipe: error:")


def test_the_largest_seed_builds_an_ivf_index() -> None:
    from recpipe.retrieval.index import train_centroids
    from recpipe.training.config import MAX_SEED

    emb = np.random.default_rng(0).standard_normal((2000, 8)).astype(np.float32)
    assert train_centroids(emb, seed=MAX_SEED).shape[1] == 8


@pytest.mark.parametrize("key, value", [("oracle", {"auc": "high", "recall_at_500": 0.9}), ("oracle", [1]),
                                        ("seed", "1"), ("scale", None), ("rows", [1])])
def test_an_edited_data_manifest_is_refused_before_training(small_dataset: Path, tmp_path: Path, capsys,
                                                            key: str, value: object) -> None:
    # before: oracle.auc = "high" trained, wrote the repository, then died printing it (a traceback, exit 1)
    import json
    import shutil

    data = tmp_path / "data"
    shutil.copytree(small_dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest[key] = value
    (data / "manifest.json").write_text(json.dumps(manifest))
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "m"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "of the wrong type" in err[0] and key in err[0]
    assert not (tmp_path / "m").exists()


def test_missing_data_dir_exit_2(tmp_path: Path) -> None:
    assert main(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "m"), "--quiet"]) == 2


def test_force_replaces_atomically_with_a_chosen_index(small_dataset: Path, small_models: Path, tmp_path: Path,
                                                      capsys) -> None:
    import shutil

    import torch

    threads = torch.get_num_threads()
    out = tmp_path / "models"
    shutil.copytree(small_models, out)  # a repository: --force replaces it (anything else is refused)
    (out / "ranking" / "dlrm.json").unlink()  # even one missing an artifact
    stale = set(Repository.open(out).manifest["files"])
    assert main(["train", "--data", str(small_dataset), "--out", str(out), "--epochs", "1", "--index", "flat",
                 "--threads", "1", "--force", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""  # --quiet
    assert torch.get_num_threads() == threads  # the run's thread setting does not leak
    assert Repository.open(out).manifest["training"]["torch_threads"] == 1
    assert (out / "ranking" / "dlrm.json").exists() and set(Repository.open(out).manifest["files"]) == stale
    manifest = Repository.open(out).manifest
    assert manifest["metrics"]["index_type"] == "flat" and manifest["metrics"]["index_recall_at_100"] == 1.0
    assert not list(tmp_path.glob(".models.*"))  # no temp dirs left behind


def test_device_resolution() -> None:
    import torch

    from recpipe.accel.device import describe, resolve
    from recpipe.errors import UsageError

    assert describe(resolve("cpu")) == "cpu"
    assert resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UsageError):
        resolve("npu")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA is not available"):
            resolve("cuda")
    else:
        assert describe(resolve("cuda")).startswith("cuda:0 (")


def test_diagnose_reproduces_the_oracle_and_splits_the_logit(small_models: Path, small_dataset: Path, capsys) -> None:
    import torch

    from recpipe.training import diagnose

    threads = torch.get_num_threads()
    assert diagnose.main(["--data", str(small_dataset), "--models", str(small_models), "--rows", "5000",
                           "--ceiling"]) == 0
    out = capsys.readouterr().out
    oracle = read_json(small_dataset / "manifest.json")["oracle"]["auc"]
    holdout = split_by_time(pl.read_parquet(small_dataset / "interactions.parquet"))[1]
    if holdout.height <= 5000:  # every held-out row: the rebuilt world gives the generator's own oracle AUC
        assert f"oracle AUC {oracle:.4f}" in out
    assert "u.v" in out and "DLRM logit ~" in out
    assert "what the features allow" in out and "+ category vector only" in out and "the DLRM" in out
    assert "DLRM dense inputs" in out
    assert "what the DLRM misses" in out and "leaf's history vector" in out and "brand's hidden dims" in out
    assert "row and tag" in out
    assert torch.get_num_threads() == threads  # it scores on one thread, and gives the caller's count back


@pytest.fixture(scope="module")
def hidden_world(small_dataset: Path) -> tuple[dict[str, Any], World, pl.DataFrame, pl.DataFrame, pl.DataFrame,
                                               pl.DataFrame]:
    """The small dataset's manifest, rebuilt hidden world, users, items, training and held-out rows."""
    from recpipe.datagen.generate import rebuild_world

    manifest = read_json(small_dataset / "manifest.json")
    world = rebuild_world(manifest)
    users = pl.read_parquet(small_dataset / "users.parquet")
    items = pl.read_parquet(small_dataset / "items.parquet")
    train, hold = split_by_time(pl.read_parquet(small_dataset / "interactions.parquet"))
    return manifest, world, users, items, train, hold


def test_stacking_finds_what_a_model_misses(hidden_world) -> None:
    """A 'model' that knows only the quality term misses the u.v dot: stacking the user's read-out dotted
    with the true v on its logit lifts the held-out AUC well above the logit's alone; stacked on the
    truth, the same term adds nothing."""
    from recpipe.training.ceiling import history_vectors, item_signals, stacked, user_signals

    _, world, users, items, train, hold = hidden_world
    us, its = hold["user_id"].to_numpy(), hold["item_id"].to_numpy()
    m = world.model
    quality = world.items.q[its].astype(np.float64) * m.quality
    dot = np.einsum("nd,nd->n", world.users.u[us].astype(np.float64), world.items.v(0, world.items.n)[its])
    truth = quality + dot * m.affinity / np.sqrt(m.latent_dim)
    partial = stacked(world, users, items, train, hold, quality)
    assert partial["+ u_seen . v"] > partial["the model"] + 0.03, partial
    full = stacked(world, users, items, train, hold, truth)
    assert list(full) == list(partial) and len(full) == 11, full
    # on the truth no term adds anything, the true u and the history vectors included (2,000 held-out
    # rows: halves of 1,000 move the AUC by up to ~0.007 by chance)
    assert all(abs(value - full["the model"]) < 0.01 for value in full.values()), full
    # the history vector is the click residual times the user's row: zero for a key nobody clicked
    keys = np.zeros(train.height, np.int64)
    vectors = history_vectors(user_signals(users), train, keys, 2)
    assert vectors.shape == (2, 32) and not vectors[1].any() and vectors[0].any()
    # the user's history vector is the click residual times the item's row: zero for a user who never clicked
    by_user = history_vectors(item_signals(items), train, train["user_id"].to_numpy(), world.users.n,
                              source="item_id")
    rate = train.group_by("user_id").agg(pl.col("label").mean())
    idle = np.setdiff1d(np.arange(world.users.n), rate.filter(pl.col("label") > 0)["user_id"].to_numpy())
    mixed = rate.filter((pl.col("label") > 0) & (pl.col("label") < 1))["user_id"].to_numpy()
    assert by_user.shape == (world.users.n, 12) and len(idle) and not by_user[idle].any()
    assert len(mixed) and np.abs(by_user[mixed]).sum(1).min() > 0


def test_feature_ceilings_fall_as_the_latents_are_read_from_the_rows(hidden_world) -> None:
    """Each ceiling hides one more part of the click logit, so none may rise much above the one
    before it; the truth's logistic fit is the oracle up to three coefficients; and the ceilings sit
    well above chance (they are fitted on the training rows, scored on the held-out ones)."""
    from recpipe.training.ceiling import ceilings, read_out

    manifest, world, users, items, train, hold = hidden_world
    got = ceilings(world, users, items, train, hold)
    assert list(got) == ["truth", "ratings for quality", "user read from its row", "+ category vector + item row",
                         "+ category vector only"]
    values = list(got.values())
    assert abs(values[0] - manifest["oracle"]["auc"]) < 0.01
    for before, after in itertools.pairwise(values):
        assert after <= before + 0.01
    assert values[-1] > 0.6
    # the read-out is least squares with an intercept: exact on a target that is linear in the input
    x = np.random.default_rng(0).standard_normal((50, 3))
    np.testing.assert_allclose(read_out(x, x @ np.array([1.0, -2.0, 0.5]) + 3.0), x @ np.array([1.0, -2.0, 0.5]) + 3.0)
