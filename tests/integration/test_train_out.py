"""``recpipe train --out``: only a model repository is ever replaced (never someone else's files, not
even with --force), the placeholder README of a checkout's models/ is kept, and the repository follows
the umask."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from recpipe.cli import main
from recpipe.repository import Repository, check_replaceable, foreign_entries

#: The placeholder tracked in git as models/README.md.
PLACEHOLDER = Path(__file__).resolve().parents[2] / "models" / "README.md"


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


def train(data: Path, out: Path, *extra: str) -> int:
    # --index flat: what auto picks at this scale anyway, without building and timing the four others
    # (6 of a tiny training's 11 s); the session's small_models keeps auto
    return main(["train", "--data", str(data), "--out", str(out), "--epochs", "1", "--index", "flat", "--quiet",
                 *extra])


def test_force_refuses_a_directory_that_is_not_a_repository(tmp_path, small_dataset, capsys):
    out = tmp_path / "work"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "thesis.tex").write_text("\\documentclass{article}")
    before = snapshot(out)
    assert train(small_dataset, out, "--force") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "not part of a recpipe model repository" in err and "notes.txt" in err and "even with --force" in err
    assert snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == ["work"]  # and no temporaries beside it


@pytest.mark.parametrize("extra", ["notes.txt", "ranking/extra.bin", "empty-dir", "link", ".hidden"])
def test_force_refuses_a_repository_holding_something_else(tmp_path, small_dataset, small_models, extra, capsys):
    out = tmp_path / "models"
    shutil.copytree(small_models, out)
    if extra == "empty-dir":
        (out / extra).mkdir()
    elif extra == "link":
        (out / extra).symlink_to(tmp_path)
    else:
        (out / extra).write_text("not recpipe's")
    assert foreign_entries(out) == [extra]
    before = snapshot(out)
    assert train(small_dataset, out, "--force") == 2
    assert extra in capsys.readouterr().err
    assert snapshot(out) == before


def test_placeholder_readme_is_kept_and_the_repository_follows_the_umask(tmp_path, small_dataset, small_models, capsys):
    assert "recpipe train" in PLACEHOLDER.read_text()
    fresh = tmp_path / "fresh"  # a checkout's models/: only the placeholder, no --force needed
    fresh.mkdir()
    shutil.copy(PLACEHOLDER, fresh / "README.md")
    check_replaceable(fresh, force=False)

    out = tmp_path / "models"  # a repository in a checkout's models/, replaced with --force
    shutil.copytree(small_models, out)
    shutil.copy(PLACEHOLDER, out / "README.md")
    old_version = Repository.open(out).version
    previous = os.umask(0o027)
    try:
        assert train(small_dataset, out, "--force", "--seed", "1") == 0
    finally:
        os.umask(previous)
    assert (out / "README.md").read_text() == PLACEHOLDER.read_text()
    assert Repository.open(out).version != old_version
    assert foreign_entries(out) == []
    for path in (out, *out.rglob("*")):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o750 if path.is_dir() else 0o640), (path, oct(mode))
    assert sorted(os.listdir(tmp_path)) == ["fresh", "models"]  # no temporaries, no old copy
    assert train(small_dataset, out) == 2
    assert "already holds a model repository; pass --force" in capsys.readouterr().err


def test_force_through_a_symlink_replaces_the_directory_it_names_and_keeps_the_link(tmp_path, small_dataset,
                                                                                   small_models):
    # before: the link (the user's, not ours) was renamed over and deleted, and its target kept the old models
    real = tmp_path / "disk" / "models"
    real.parent.mkdir()
    shutil.copytree(small_models, real)
    old_version = Repository.open(real).version
    link = tmp_path / "models"
    link.symlink_to(real)
    assert train(small_dataset, link, "--force", "--seed", "1") == 0
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert Repository.open(real).version != old_version
    assert sorted(os.listdir(tmp_path)) == ["disk", "models"] and os.listdir(real.parent) == ["models"]


def test_a_failed_run_leaves_no_directory_it_made_for_out(tmp_path, small_dataset, capsys):
    data = tmp_path / "data"
    shutil.copytree(small_dataset, data)
    (data / "users.parquet").write_bytes(b"not the users table")  # found only once training has started
    (tmp_path / "kept").mkdir()
    assert train(data, tmp_path / "kept" / "new" / "deeper" / "models") == 2
    assert "users.parquet" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["data", "kept"] and not os.listdir(tmp_path / "kept")


def test_a_parent_that_cannot_be_made_leaves_none_of_the_ones_made_before_it(tmp_path, small_dataset, capsys):
    out = tmp_path / "new" / ("x" * 300) / "models"  # "new" is made, then the long name fails
    assert train(small_dataset, out) == 2
    assert "cannot create" in capsys.readouterr().err and not os.listdir(tmp_path)
