"""The benches' shared argument checks: a missing --models/--data is one usage error naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from recpipe.bench._args import require_dirs
from recpipe.cli import main
from recpipe.errors import UsageError


def test_require_dirs_names_the_first_missing_flag(tmp_path: Path) -> None:
    require_dirs(("--models", tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match=r"^--data .*file: not a directory$"):  # e.g. data/users.parquet
        require_dirs(("--models", tmp_path), ("--data", tmp_path / "file"), ("--x", tmp_path / "nope"))
    with pytest.raises(UsageError, match=r"^--x .*nope: no such directory$"):
        require_dirs(("--models", tmp_path), ("--x", tmp_path / "nope"), ("--data", tmp_path / "file"))


@pytest.mark.parametrize("bench", ["chain", "features"])
def test_benches_refuse_a_missing_models_dir(bench: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert main(["bench", bench, "--models", str(missing), "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--models {missing}: no such directory" in err[0]


@pytest.mark.parametrize("idle_ms", ["-1", "1001"])
def test_bench_ranking_refuses_an_idle_time_out_of_range(idle_ms: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "ranking", "--models", str(tmp_path), "--data", str(tmp_path), "--idle-ms", idle_ms]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--idle-ms must be in [0, 1000]" in err[0]
