"""Writing and reading run documents, and the plain-text summary printed after a run."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from recpipe.errors import UsageError
from recpipe.filemodes import file_mode

FORMAT = "recpipe.querygen.run"
SUPPORTED_VERSIONS = (1,)


def check_writable(path: str | Path, force: bool) -> Path:
    """Refuse early (before a long run) to overwrite ``path`` without --force."""
    p = Path(path)
    if p.exists() and not force:
        raise UsageError(f"{p} exists; pass --force to overwrite it")
    if not p.parent.exists():
        raise UsageError(f"directory {p.parent} does not exist")
    return p


def write_atomic(path: str | Path, data: bytes, force: bool) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same directory and a rename."""
    p = check_writable(path, force)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        os.fchmod(fd, file_mode())  # mkstemp's 0600 -> what any other tool would write
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def write_json(path: str | Path, doc: dict[str, Any], force: bool) -> Path:
    return write_atomic(path, (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode(), force)


def load_run(path: str | Path) -> dict[str, Any]:
    """Read a run document written by ``recpipe querygen --out``; UsageError if it is not one."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {p}: {e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{p} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UsageError(f"{p} is not a recpipe querygen run (format {FORMAT!r} missing)")
    if doc.get("format_version") not in SUPPORTED_VERSIONS:
        raise UsageError(f"{p}: format_version {doc.get('format_version')!r} is not supported "
                         f"(this recpipe reads {SUPPORTED_VERSIONS})")
    for key in ("end_to_end", "stages"):
        if not isinstance(doc.get(key), dict):
            raise UsageError(f"{p}: missing {key!r}")
    return doc


def summary_text(doc: dict[str, Any]) -> str:
    """The per-stage table printed after a run (see ``recpipe.querygen.table``)."""
    from recpipe.querygen.table import run_table

    return run_table(doc)
