"""The one way recpipe writes a file: atomically, never over an existing one without ``force``.

A temporary file in the target's directory is written, flushed and fsynced, renamed over the target
(``os.replace``, atomic on POSIX within one filesystem), and the directory is fsynced so the rename
itself survives a crash. On any failure the temporary file is removed and the target is untouched.
``swap_dir`` moves a finished directory into place the same way, and ``write_files`` writes a set of
files (a run document and its charts, a report) that appear together or not at all.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from recpipe import termination
from recpipe.errors import UsageError
from recpipe.filemodes import file_mode

Writer = Callable[[Path], object]


def check_writable(path: str | Path, force: bool) -> Path:
    """Refuse early (before a long run) to write the file ``path``: over an existing one without --force,
    over a directory, or where no file can be created (``check_creatable``)."""
    p = _file_target(path, force)
    check_creatable(p.parent)
    return p


def _file_target(path: str | Path, force: bool) -> Path:
    """``path`` as a file to write: not a directory, not there unless ``force``, in a directory that is.
    A symlink is followed (``link_target``): the file it names is the one written, and the link stays."""
    p = link_target(path)
    if p.is_dir():
        raise UsageError(f"{p} is a directory; give a file name")
    if p.exists() and not force:
        raise UsageError(f"{p} exists; pass --force to overwrite it")
    if not p.parent.exists():
        raise UsageError(f"directory {p.parent} does not exist")
    return p


def check_creatable(directory: str | Path) -> Path:
    """``directory`` if a file can be created in it, else a UsageError saying why. It tries: permission
    bits say nothing to root, and nothing at all of /proc or a read-only mount."""
    d = Path(directory)
    fd, name = _mkstemp(d, prefix=".recpipe-probe-")
    os.close(fd)
    Path(name).unlink(missing_ok=True)
    return d


def _mkstemp(directory: Path, prefix: str, suffix: str = "") -> tuple[int, str]:
    """``tempfile.mkstemp`` in ``directory``; a UsageError saying why where no file can be created."""
    try:
        return tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    except OSError as e:
        raise UsageError(f"cannot write in {directory}: {e.strerror or e}") from None


def write_atomic(path: str | Path, data: bytes | str | Writer, *, force: bool) -> Path:
    """Write ``data`` to ``path`` atomically; ``UsageError`` if ``path`` exists and not ``force``.

    ``data`` is bytes, text (UTF-8), or a callable given the temporary path to write itself, for
    libraries that only write to a path (pyarrow, FAISS, safetensors, matplotlib). The temporary
    path ends with the target's suffix, so a library that picks its format by suffix picks the same.
    """
    p = _file_target(path, force)
    fd, name = _mkstemp(p.parent, prefix=f".{p.name}.", suffix=f".tmp{p.suffix}")  # its own temporary: no probe
    tmp = Path(name)
    try:
        try:
            os.fchmod(fd, file_mode())  # mkstemp's 0600 -> what any other tool would write
            if not callable(data):
                with os.fdopen(fd, "wb", closefd=False) as f:
                    f.write(data.encode() if isinstance(data, str) else data)
        finally:
            os.close(fd)
        if callable(data):
            data(tmp)
            os.chmod(tmp, file_mode())  # some libraries (safetensors) recreate the file 0600
        _fsync_path(tmp)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(p.parent)
    return p


def write_files(files: Mapping[Path, bytes | str | Writer], force: bool) -> list[Path]:
    """Write ``files`` (path -> content, as ``write_atomic`` takes it) as one set: each to a hidden
    temporary name beside its target, and only once all are written, each renamed into place. On any
    failure, Ctrl-C included, the temporary files are removed and, without ``force``, the targets already
    renamed too: a report's charts left without its report.md would make the rerun refuse them for want
    of --force."""
    targets = {path: check_writable(path, force) for path in files}  # a symlink's target, not the link
    if len(set(targets.values())) < len(targets):
        raise UsageError(f"two of {', '.join(map(str, files))} name the same file (through a symlink)")
    temps: dict[Path, Path] = {}
    placed: list[Path] = []
    try:
        for path, data in files.items():
            target = targets[path]
            temps[target] = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
            write_atomic(temps[target], data, force=False)
        termination.check()  # asked to stop while drawing: commit nothing
        for target, tmp in temps.items():
            os.replace(tmp, target)
            placed.append(target)
    except BaseException:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        if not force:  # they did not exist before (checked above): back to no set at all
            for path in placed:
                path.unlink(missing_ok=True)
        raise
    for directory in {p.parent for p in targets.values()}:  # the renames survive a crash
        _fsync_path(directory)
    return list(files)


@contextlib.contextmanager
def output_dir(path: str | Path, flag: str) -> Iterator[Path]:
    """``path`` as a directory to write into, created now (``UsageError`` if it is a file or cannot be
    created or written in) so that a bad one is refused before the work, not after it; if the work then
    fails, the directories created here are removed again (those that nothing else went into)."""
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise UsageError(f"{flag} {d} is not a directory")
    created = missing_dirs(d)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        remove_empty(created)  # those made before the one that could not be
        raise UsageError(f"{flag} {d}: cannot create the directory: {e.strerror or e}") from None
    try:
        check_creatable(d)
        yield d
    except BaseException:
        remove_empty(created)
        raise


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, deepest first: what ``mkdir -p`` of it will make,
    and what ``remove_empty`` takes away again when the work fails."""
    return [p for p in (path, *path.parents) if not p.exists()]


def remove_empty(directories: Sequence[Path]) -> None:
    """Remove each of ``directories`` (deepest first) that is empty: those a command made and then put
    nothing into; anything else (not empty, gone, not ours to remove) is left as it is."""
    for p in directories:
        with contextlib.suppress(OSError):
            p.rmdir()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_target(out: str | Path) -> Path:
    """``out``, or where it points when it is a symlink (``models -> /disk/models``, ``latest.json ->
    run-7.json``): the directory or file to build beside and replace, so that the user's link stays and
    what it names is the new one (renaming over the link would delete the link and leave its target
    stale; a dangling link names the path to create). A loop of links is a ``UsageError``."""
    out = Path(out)
    if not out.is_symlink():
        return out
    try:
        return out.resolve()
    except (RuntimeError, OSError) as e:  # a loop of links (RuntimeError on Python < 3.13, OSError after)
        raise UsageError(f"{out} is a symlink that resolves to no path ({e})") from None


def swap_dir(tmp: Path, out: Path) -> None:
    """Move the finished directory ``tmp`` (a sibling of ``out``) to ``out`` by renames.

    An existing ``out`` is first moved aside into a hidden sibling and deleted only once ``tmp`` is in
    place; if that rename fails, it is put back. The caller decides whether ``out`` may be replaced.
    Refuses (``Terminated``, nothing moved) once the process was asked to terminate. ``out`` is not
    a symlink (``link_target``): the rename would replace the link, not the directory it names.
    """
    termination.check()
    out = Path(out)
    parent = out.absolute().parent
    if not out.exists():
        os.rename(tmp, out)
        _fsync_path(parent)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
    os.rename(out, old / "data")
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old / "data", out)
        shutil.rmtree(old, ignore_errors=True)
        raise
    _fsync_path(parent)
    shutil.rmtree(old, ignore_errors=True)
