"""``recpipe characterize`` checks every setting before it writes or measures anything: a bad one is one line
naming its flag, exit code 2, and no characterization.json that would block the corrected rerun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recpipe.cli import main


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "foo=2"], "--replicas: unknown stage 'foo': choose features, retrieval, ranking, gateway"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--serve-arg=--bogus"], "--serve-arg --bogus: unrecognized arguments: --bogus"),
    (["--serve-arg=--max-batch=-1"], "--serve-arg --max-batch=-1: --max-batch must be >= 0 (0 = auto), got -1"),
    (["--serve-arg=--max-batch", "--serve-arg=x"], "--serve-arg --max-batch x: serve: argument --max-batch: "
                                                   "invalid int value: 'x'"),
    (["--serve-arg=-h"], "--serve-arg --help: a stage cannot run with it (see `recpipe serve --help`)"),
])
def test_a_bad_setting_is_refused_before_anything_is_written(
        flags: list[str], message: str, small_dataset: Path, small_models: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ch"
    argv = ["characterize", "--out", str(out), "--data", str(small_dataset), "--models", str(small_models), "--quick",
            "--device", "cpu", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"recpipe: error: {message}"]
    assert not out.exists()


def test_data_and_models_are_what_their_flags_say(small_dataset: Path, small_models: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ch"

    def refused(data: Path, models: Path) -> str:
        assert main(["characterize", "--out", str(out), "--data", str(data), "--models", str(models), "--quick",
                     "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and not out.exists(), err
        return err[0]

    assert refused(small_models, small_dataset).startswith(f"recpipe: error: --data: {small_models} is a model "
                                                            "repository")
    assert refused(small_dataset, small_dataset).startswith(f"recpipe: error: --models: {small_dataset} is a dataset")
    # another dataset than the one the models were trained on (its manifest: other files, so another identity)
    other = tmp_path / "other"
    other.mkdir()
    manifest = json.loads((small_dataset / "manifest.json").read_text())
    manifest["sha256"] = {name: "0" * 64 for name in manifest["sha256"]}
    (other / "manifest.json").write_text(json.dumps(manifest))
    err = refused(other, small_models)
    assert err.startswith("recpipe: error: --data and --models: ") and "does not match" in err
