"""recpipe.files.write_atomic: content, permissions, refusal without force, nothing left on failure."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from recpipe.errors import UsageError
from recpipe.files import check_writable, link_target, output_dir, swap_dir, write_atomic, write_files


def _leftovers(d: Path, keep: str) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name != keep)


def test_bytes_text_and_writer_land_with_their_content(tmp_path: Path) -> None:
    assert write_atomic(tmp_path / "a.bin", b"\x00\x01", force=False).read_bytes() == b"\x00\x01"
    assert write_atomic(tmp_path / "b.txt", "héllo\n", force=False).read_bytes() == "héllo\n".encode()
    seen: list[Path] = []

    def writer(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text("from a library")

    out = write_atomic(tmp_path / "c.parquet", writer, force=False)
    assert out.read_text() == "from a library"
    # the library saw a temporary sibling with the target's suffix, never the target itself
    assert seen[0].parent == tmp_path and seen[0].name != "c.parquet" and seen[0].suffix == ".parquet"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.txt", "c.parquet"]


def test_mode_follows_the_umask_even_when_the_writer_recreates_the_file(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        def private(tmp: Path) -> None:  # as safetensors does: a fresh 0600 file
            tmp.unlink()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)

        a = write_atomic(tmp_path / "a", b"x", force=False)
        b = write_atomic(tmp_path / "b", private, force=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(a.stat().st_mode) == 0o644
    assert stat.S_IMODE(b.stat().st_mode) == 0o644


def test_refuses_to_overwrite_without_force_and_replaces_with_it(tmp_path: Path) -> None:
    target = tmp_path / "run.json"
    target.write_text("old")
    with pytest.raises(UsageError, match="exists; pass --force"):
        write_atomic(target, "new", force=False)
    assert target.read_text() == "old"
    write_atomic(target, "new", force=True)
    assert target.read_text() == "new"
    assert _leftovers(tmp_path, "run.json") == []


def test_missing_directory_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        check_writable(tmp_path / "nope" / "x.json", force=False)


def test_a_failing_writer_leaves_the_target_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "index.faiss"
    target.write_text("old")

    def half(tmp: Path) -> None:
        tmp.write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(target, half, force=True)
    assert target.read_text() == "old"
    assert _leftovers(tmp_path, "index.faiss") == []


def test_bad_data_leaves_no_temporary(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "x", 42, force=False)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_swap_dir_moves_in_and_replaces_keeping_nothing_aside(tmp_path: Path) -> None:
    out = tmp_path / "data"
    first = tmp_path / ".data.tmp-1"
    first.mkdir()
    (first / "a").write_text("1")
    swap_dir(first, out)
    assert (out / "a").read_text() == "1" and not first.exists()
    second = tmp_path / ".data.tmp-2"
    second.mkdir()
    (second / "b").write_text("2")
    swap_dir(second, out)
    assert sorted(p.name for p in out.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_swap_dir_puts_the_old_directory_back_when_the_move_fails(tmp_path: Path) -> None:
    out = tmp_path / "data"
    out.mkdir()
    (out / "a").write_text("old")
    with pytest.raises(FileNotFoundError):
        swap_dir(tmp_path / "missing", out)
    assert (out / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_swap_dir_moves_nothing_once_termination_was_requested(tmp_path: Path) -> None:
    """A SIGTERM whose raise got swallowed (in a finalizer) must still stop the commit."""
    from recpipe import termination
    from recpipe.files import swap_dir

    tmp = tmp_path / ".out.tmp-1"
    tmp.mkdir()
    termination.request()
    try:
        with pytest.raises(termination.Terminated):
            swap_dir(tmp, tmp_path / "out")
    finally:
        termination.reset()
    assert tmp.is_dir() and not (tmp_path / "out").exists()
    swap_dir(tmp, tmp_path / "out")  # once reset, the commit goes through
    assert (tmp_path / "out").is_dir()


def test_a_symlinked_file_target_is_followed_and_the_link_kept(tmp_path: Path) -> None:
    # a dangling link is the user's entry: the file it names is created, the link is not replaced
    (tmp_path / "latest.json").symlink_to("run-1.json")
    write_atomic(tmp_path / "latest.json", "new\n", force=False)
    assert (tmp_path / "latest.json").is_symlink()
    assert (tmp_path / "run-1.json").read_text() == "new\n"
    # a link to an existing file: refused without force (it exists), and with force the file it names
    # is replaced, the link staying
    with pytest.raises(UsageError, match="pass --force"):
        check_writable(tmp_path / "latest.json", force=False)
    write_atomic(tmp_path / "latest.json", "newer\n", force=True)
    assert (tmp_path / "latest.json").is_symlink()
    assert (tmp_path / "run-1.json").read_text() == "newer\n"
    assert _leftovers(tmp_path, "latest.json") == ["run-1.json"]


def test_write_files_follows_symlinks_and_keeps_them(tmp_path: Path) -> None:
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.md").symlink_to(tmp_path / "kept.md")  # dangling
    write_files({out / "report.md": "text\n", out / "a.png": b"png"}, force=False)
    assert (out / "report.md").is_symlink() and (tmp_path / "kept.md").read_text() == "text\n"
    assert sorted(p.name for p in out.iterdir()) == ["a.png", "report.md"]
    with pytest.raises(UsageError, match="same file"):
        write_files({out / "report.md": "x", tmp_path / "kept.md": "y"}, force=True)
    assert (tmp_path / "kept.md").read_text() == "text\n"


def test_a_symlink_loop_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(UsageError, match="symlink"):
        link_target(tmp_path / "a")
    with pytest.raises(UsageError, match="symlink"):
        write_atomic(tmp_path / "a", "x", force=True)
    assert (tmp_path / "a").is_symlink() and (tmp_path / "b").is_symlink()


def test_output_dir_removes_the_directories_it_made_when_the_work_or_the_making_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), output_dir(tmp_path / "a" / "b", "--out") as out:
        assert out.is_dir()
        raise RuntimeError("the work failed")
    with pytest.raises(UsageError, match="cannot create the directory"), \
            output_dir(tmp_path / "new" / ("x" * 300), "--out"):  # "new" is made, then the long name fails
        pass
    assert not os.listdir(tmp_path)
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError), output_dir(tmp_path / "kept" / "c", "--out") as out:
        (out / "mine.txt").write_text("written before the failure")
        raise RuntimeError("the work failed")
    assert os.listdir(tmp_path / "kept" / "c") == ["mine.txt"]  # not empty: left as it is
