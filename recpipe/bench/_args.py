"""Argument checks shared by the benches: each error names the flag and the value it refuses."""

from __future__ import annotations

import math
from pathlib import Path

from recpipe.errors import UsageError

Number = int | float


def require_dirs(*flags: tuple[str, str | Path]) -> None:
    """``UsageError`` "--models PATH: no such directory" (or "not a directory", where a file stands there)
    for the first (flag, path) that is not a directory."""
    for flag, path in flags:
        if not Path(path).is_dir():
            raise UsageError(f"{flag} {path}: {'not a directory' if Path(path).exists() else 'no such directory'}")


def at_least(low: Number, *flags: tuple[str, Number]) -> None:
    """``UsageError`` "--warmup must be >= 0, got -1" for the first (flag, value) below ``low`` (or NaN, infinite)."""
    for flag, value in flags:
        if not (math.isfinite(value) and value >= low):
            raise UsageError(f"{flag} must be {_finite(value)}>= {low}, got {value}")


def above(low: Number, *flags: tuple[str, Number]) -> None:
    """``UsageError`` "--timeout must be a finite number > 0, got nan" for the first (flag, value) not above ``low``."""
    for flag, value in flags:
        if not (math.isfinite(value) and value > low):
            raise UsageError(f"{flag} must be {_finite(value)}> {low}, got {value}")


def within(low: Number, high: Number, *flags: tuple[str, Number]) -> None:
    """``UsageError`` "--num-candidates must be in 1..10000, got 0" for the first (flag, value) outside."""
    for flag, value in flags:
        if not low <= value <= high:
            raise UsageError(f"{flag} must be in {low}..{high}, got {value}")


def _finite(value: Number) -> str:
    return "a finite number " if isinstance(value, float) else ""


def check_out(flag: str, path: Path | None, force: bool) -> None:
    """Before the run: ``path`` (None: not asked for) can be written, and is not there unless ``force``;
    ``UsageError`` naming ``flag`` otherwise (``recpipe.files.check_writable``)."""
    if path is None:
        return
    from recpipe.files import check_writable

    try:
        check_writable(path, force)
    except UsageError as e:
        raise UsageError(f"{flag}: {e}") from None
