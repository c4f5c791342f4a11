"""RankingCore with --ranking-precision, and a DCN repository trained, loaded and served end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recpipe.cli import main
from recpipe.errors import UsageError
from recpipe.features.core import FeatureCore
from recpipe.ranking.core import RankingCore
from recpipe.ranking.options import RankingOptions
from recpipe.repository import Repository


def _request(features: FeatureCore, k: int = 40) -> tuple:
    rng = np.random.default_rng(5)
    return features.augment_user(3), features.augment_items(3, rng.choice(features.num_items, k, replace=False))


def test_precisions_load_serve_and_say_what_runs(small_models: Path, small_dataset: Path) -> None:
    features = FeatureCore.load(small_models, small_dataset)
    user, items = _request(features)
    fp32 = RankingCore.load(small_models, device="cpu")
    int8 = RankingCore.load(small_models, device="cpu", precision="int8")
    assert (fp32.details["precision"], int8.details["precision"]) == ("fp32", "int8")
    assert fp32.details["interaction"] == "dot" and fp32.details["cpu_isa"]
    assert fp32.details["wide"].startswith("user dense columns 8-39 x item dense columns 8-19 and x table ")
    ref, low = fp32.rank(user, items), int8.rank(user, items)
    # close, not equal: int8 rounds every activation (its AUC cost is what auto weighs, below); the
    # bilinear bottoms of issue 23 widened the dots' range, so the rounding costs more than it did
    assert low.shape == ref.shape and np.corrcoef(ref, low)[0, 1] > 0.95
    auto = RankingCore.load(small_models, device="cpu", precision="auto")
    measured = Repository.open(small_models).section("metrics")["ranking_auc_by_precision"]
    assert auto.precision.form in measured and auto.precision.reason.startswith("auto: fastest within dAUC")
    for form, value in measured.items():  # a form over the AUC budget is never the one picked
        if measured["fp32"] - value > 0.002:
            assert auto.precision.form != form
    with pytest.raises(UsageError, match="--ranking-precision"):
        RankingCore.load(small_models, device="cpu", precision="fp16")
    with pytest.raises(UsageError, match="--ranking-precision"):
        RankingOptions(precision="fp16")


@pytest.mark.slow
def test_a_dcn_repository_trains_loads_and_ranks(small_dataset: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "dcn"
    assert main(["train", "--data", str(small_dataset), "--out", str(out), "--epochs", "2",
                 "--interaction", "dcn"]) == 0
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
