"""RankingCore with --ranking-precision, and a DCN repository trained, loaded and served end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from recpipe.cli import main
from recpipe.errors import ArtifactMismatch, UsageError
from recpipe.features.core import FeatureCore
from recpipe.ranking.core import RankingCore
from recpipe.ranking.options import RankingOptions
from recpipe.repository import Repository


def _request(features: FeatureCore, k: int = 40) -> tuple:
    rng = np.random.default_rng(5)
    return features.augment_user(3), features.augment_items(3, rng.choice(features.num_items, k, replace=False))


def test_precisions_load_serve_and_say_what_runs(small_models: Path, small_dataset: Path, bf16_ranking: RankingCore,
                                                 monkeypatch) -> None:
    from recpipe.ranking import precision, probe

    # bf16 is offered only where the CPU computes it natively; force it so that every machine kind
    # takes the compiled path here (emulated where not native: slower, the same numbers)
    monkeypatch.setattr(precision, "native_bf16", lambda flags=None: True)
    features = FeatureCore.load(small_models, small_dataset)
    user, items = _request(features)
    fp32 = RankingCore.load(small_models, device="cpu")
    int8 = RankingCore.load(small_models, device="cpu", precision="int8")
    assert (fp32.details["precision"], int8.details["precision"]) == ("fp32", "int8")
    assert fp32.details["interaction"] == "dot" and fp32.details["cpu_isa"]
    assert fp32.details["wide"].startswith("user dense columns 8-39 x item dense columns 8-19 and x table ")
    assert fp32.details["precision_bound"] == f"max |dp| <= {probe.MAX_ABS_DP:g}, dAUC >= -{precision.AUC_BUDGET:g} against fp32"
    ref, low = fp32.rank(user, items), int8.rank(user, items)
    # close, not equal: int8 rounds every activation (whether it keeps the bound is checked at load)
    assert low.shape == ref.shape and np.corrcoef(ref, low)[0, 1] > 0.95
    # asked for by name: served whatever its check says, and the check is reported
    check = int8.checks["int8"]
    assert "held-out rows" in check.source and int8.details["precision_check"] == check.describe()
    assert check.max_abs_dp == pytest.approx(np.max(np.abs(probe_scores(int8, small_models) - probe_scores(fp32, small_models))), abs=1e-6)
    auto = RankingCore.load(small_models, device="cpu", precision="auto")
    measured = Repository.open(small_models).section("metrics")["ranking_auc_by_precision"]
    assert auto.precision.form in measured and auto.precision.reason.startswith("auto: fastest within the bound")
    assert set(auto.checks) == {"bf16", "int8"}  # every form auto may pick was checked at load
    for form, value in measured.items():  # a form over the AUC budget or the |dp| bound is never picked
        if measured["fp32"] - value > precision.AUC_BUDGET or (form in auto.checks and not auto.checks[form].ok):
            assert auto.precision.form != form
    bf16 = bf16_ranking  # RankingCore.load(small_models, device="cpu", precision="bf16"), bf16 forced (conftest)
    assert bf16.details["precision"] == "bf16 (torch.compile)" and bf16.checks["bf16"].ok
    # the segmented form (recpipe.ranking.segmented): batches of 2-8 requests x every candidate bucket
    # (users 2, 4, 8 x candidates 64-512 in powers of two, then every 512: 3 x 11 shapes)
    assert bf16.details["warmed"].startswith("33 shapes (2-8 users x 64-4096 candidates)")
    assert bf16.details["batch_forward"].startswith("segmented, up to 8 requests")
    assert fp32.details["batch_forward"] == "up to 32 requests per forward"
    np.testing.assert_allclose(bf16.rank(user, items), ref, atol=probe.MAX_ABS_DP)
    with pytest.raises(UsageError, match="--ranking-precision"):
        RankingCore.load(small_models, device="cpu", precision="fp16")
    with pytest.raises(UsageError, match="--ranking-precision"):
        RankingOptions(precision="fp16")


def probe_scores(core: RankingCore, models: Path) -> np.ndarray:
    from recpipe.ranking import probe

    rows = probe.load(Repository.open(models), core.limits)
    assert rows is not None
    return probe.scores(core.predictor, rows)


def test_the_probe_is_trained_rows_and_an_old_repository_is_checked_on_random_rows(
        small_models: Path, tmp_path: Path) -> None:
    from recpipe.ranking import probe
    from recpipe.repository import write_manifest

    fp32 = RankingCore.load(small_models, device="cpu")
    repo = Repository.open(small_models)
    rows = probe.load(repo, fp32.limits)
    assert rows is not None and rows.labels is not None and 0 < rows.rows <= probe.PROBE_ROWS
    assert rows.rows == int(rows.counts.sum()) and 0 < rows.labels.mean() < 1
    # a repository written before probes: the forms are checked on random rows (no labels, no AUC)
    old = tmp_path / "old"
    shutil.copytree(small_models, old)
    (old / probe.PROBE_FILE).unlink()
    manifest = json.loads((old / "manifest.json").read_text())
    write_manifest(old, {k: v for k, v in manifest.items() if k not in ("files", "version", "format")})
    int8 = RankingCore.load(old, device="cpu", precision="int8")
    assert "random rows" in int8.checks["int8"].source and int8.checks["int8"].auc_delta is None
    # a probe that does not fit the model is refused, naming the file
    (old / probe.PROBE_FILE).write_bytes((small_models / probe.PROBE_FILE).read_bytes()[:-7])
    manifest = json.loads((old / "manifest.json").read_text())
    write_manifest(old, {k: v for k, v in manifest.items() if k not in ("files", "version", "format")})
    with pytest.raises(ArtifactMismatch, match=r"probe\.safetensors"):
        RankingCore.load(old, device="cpu", precision="int8")


@pytest.mark.slow
def test_a_dcn_repository_trains_loads_and_ranks(small_dataset: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "dcn"
    assert main(["train", "--data", str(small_dataset), "--out", str(out), "--epochs", "2",
                 "--interaction", "dcn", "--index", "flat"]) == 0  # flat: auto's pick here, without timing the others
    printed = capsys.readouterr().out
    assert "dcn interaction, epoch" in printed and "seconds: preprocess" in printed
    m = Repository.open(out).manifest["metrics"]
    assert m["ranking_interaction"] == "dcn" and 1 <= m["ranking_epoch"] <= m["ranking_epochs_run"] <= 2
    assert 0.5 < m["ranking_auc"] <= 1.0
    ranking = RankingCore.load(out, device="cpu", precision="int8")
    assert ranking.details["interaction"] == "dcn"
    features = FeatureCore.load(out, small_dataset)
    user, items = _request(features)
    scores = ranking.rank(user, items)
    assert scores.shape == (40,) and np.all((scores > 0) & (scores < 1))


def test_serve_refuses_an_unknown_ranking_precision(capsys) -> None:
    assert main(["serve", "--ranking-precision", "fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ranking-precision" in err[0]
