"""The characterization document: one versioned JSON file, rewritten atomically as each section ends.

``DIR/characterization.json``::

    {"format": "recpipe.characterization", "format_version": 1, "recpipe_version": ...,
     "started_utc": ..., "updated_utc": ..., "settings": {...},
     "sections": {"platform": {...}, "sequential": {...}, "sweep": {...}, "slo": {...}, "micro": {...},
                  "data_paths": {...}},
     "not_run": {"slo": "budget of 60 s spent", ...}}

A section is in ``sections`` only once it finished, so a rerun with the same --out skips it. A document
written before a section existed (``data_paths``, and ``transfers_per_query`` in ``sequential``) is
still read: the report says "not measured" where it lacks one, and says nothing of a part it lacks
(``load`` and ``compute_cpu_s_per_query`` in ``sequential`` and the sweep's points).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from recpipe import __version__
from recpipe.errors import UsageError
from recpipe.querygen.output import load_document, write_json

FORMAT = "recpipe.characterization"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
FILENAME = "characterization.json"
#: in the order they run
SECTIONS: tuple[str, ...] = ("platform", "sequential", "sweep", "slo", "micro", "data_paths")


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new(settings: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "recpipe_version": __version__,
            "started_utc": now_utc(), "updated_utc": now_utc(), "settings": settings, "sections": {},
            "not_run": {}}


def save(path: Path, doc: dict[str, Any]) -> None:
    doc["updated_utc"] = now_utc()
    write_json(path, doc, force=True)


def peek_format(path: str | Path) -> str | None:
    """The ``format`` field of a JSON document, or of DIR/characterization.json for a directory (None
    when it is not a JSON object with one)."""
    p = Path(path)
    try:
        doc = json.loads((p / FILENAME if p.is_dir() else p).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc.get("format") if isinstance(doc, dict) else None


def load(path: str | Path) -> dict[str, Any]:
    """Read a characterization; UsageError if it is not one this recpipe reads."""
    p = Path(path)
    if p.is_dir():
        p = p / FILENAME
    doc = load_document(p, FORMAT, SUPPORTED_VERSIONS, "a recpipe characterization")
    if not isinstance(doc.get("settings"), dict) or not isinstance(doc.get("sections"), dict):
        raise UsageError(f"{p}: missing 'settings' or 'sections'")
    return doc
