"""Writing and reading run documents, and the plain-text summary printed after a run."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from recpipe.errors import UsageError
from recpipe.files import write_atomic

FORMAT = "recpipe.querygen.run"
SUPPORTED_VERSIONS = (1,)


def document_text(doc: dict[str, Any]) -> str:
    """``doc`` as the JSON text ``write_json`` writes."""
    return json.dumps(doc, indent=2, sort_keys=False) + "\n"


def write_json(path: str | Path, doc: dict[str, Any], force: bool) -> Path:
    return write_atomic(path, document_text(doc), force=force)


def load_document(path: str | Path, fmt: str, versions: Iterable[int], what: str) -> dict[str, Any]:
    """Read a recpipe JSON document of format ``fmt`` (a version in ``versions``); ``UsageError`` naming
    the file and ``what`` it should have been otherwise."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {p}: {e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{p} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise UsageError(f"{p} is not {what} (format {fmt!r} missing)")
    supported = tuple(versions)
    if doc.get("format_version") not in supported:
        raise UsageError(f"{p}: format_version {doc.get('format_version')!r} is not supported "
                         f"(this recpipe reads {supported})")
    return doc


def load_run(path: str | Path) -> dict[str, Any]:
    """Read a run document written by ``recpipe querygen --out``; UsageError if it is not one."""
    doc = load_document(path, FORMAT, SUPPORTED_VERSIONS, "a recpipe querygen run")
    for key in ("end_to_end", "stages"):
        if not isinstance(doc.get(key), dict):
            raise UsageError(f"{path}: missing {key!r}")
    return doc


def summary_text(doc: dict[str, Any]) -> str:
    """The per-stage table printed after a run (see ``recpipe.querygen.table``)."""
    from recpipe.querygen.table import run_table

    return run_table(doc)
