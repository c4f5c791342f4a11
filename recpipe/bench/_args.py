"""Argument checks shared by the benches."""

from __future__ import annotations

from pathlib import Path

from recpipe.errors import UsageError


def require_dirs(*flags: tuple[str, str | Path]) -> None:
    """``UsageError`` "--models PATH: no such directory" for the first (flag, path) that is not a directory."""
    for flag, path in flags:
        if not Path(path).is_dir():
            raise UsageError(f"{flag} {path}: no such directory")
