"""The characterization document: one versioned JSON file, rewritten atomically as each section ends.

``DIR/characterization.json``::

    {"format": "recpipe.characterization", "format_version": 1, "recpipe_version": ...,
     "started_utc": ..., "updated_utc": ..., "settings": {...},
     "sections": {"platform": {...}, "sequential": {...}, "sweep": {...}, "slo": {...}, "micro": {...},
                  "data_paths": {...}},
     "not_run": {"slo": "budget of 60 s spent", ...}}

A section is in ``sections`` once it ran, so a rerun with the same --out skips it, unless the budget
cut it short (``cut_short``: the sweep stopped for it, or an SLO bound or a micro-benchmark was left
out): a rerun measures that section again, and until then ``not_run`` names what it lacks. A document
written before a section existed (``data_paths``, and ``transfers_per_query`` in ``sequential``) is
still read: the report says "not measured" where it lacks one, and says nothing of a part it lacks
(``load`` and ``compute_cpu_s_per_query`` in ``sequential`` and the sweep's points).

Each serving section (sequential, sweep, slo) says how it counted in its ``counts`` (``COUNTS``), written
by characterize with the block, so a document resumed from an older one says it section by section; a
block from before the field is read as ``counted`` guesses it.
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


#: ``counts.latency`` of a serving section: its p50/p99 over every query, a failed one until its deadline
#: at least (``EVERY_QUERY``), or over the answered ones only, the failed left out (``ANSWERED``)
EVERY_QUERY = "every query"
ANSWERED = "answered"
#: ``counts.cpu_per_query``: the processes' CPU divided over the queries answered (``ANSWERED``) or over
#: every query sent, refused and timed-out ones too (``SENT``); the warm-up's queries are in both
SENT = "sent"
#: how a serving section measured now counts (its block's ``counts``)
COUNTS: dict[str, str] = {"latency": EVERY_QUERY, "cpu_per_query": ANSWERED}


def counted(doc: dict[str, Any], name: str) -> dict[str, str]:
    """How serving section ``name`` of ``doc`` counted (its ``counts``). A block from before the field: its
    latency over every query where the sequential section kept ``end_to_end_all`` (which came with that
    counting), else over the answered queries; its CPU over every query sent."""
    sec = doc["sections"]
    given = (sec.get(name) or {}).get("counts")
    legacy = {"latency": EVERY_QUERY if "end_to_end_all" in (sec.get("sequential") or {}) else ANSWERED,
              "cpu_per_query": SENT}
    return {**legacy, **given} if isinstance(given, dict) else legacy


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new(settings: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "recpipe_version": __version__,
            "started_utc": now_utc(), "updated_utc": now_utc(), "settings": settings, "sections": {},
            "not_run": {}}


def save(path: Path, doc: dict[str, Any]) -> None:
    doc["updated_utc"] = now_utc()
    write_json(path, doc, force=True)


def cut_short(name: str, block: dict[str, Any]) -> str | None:
    """What the budget left out of a section that ran (None where it ran whole): a rerun measures it again."""
    if name == "sweep" and block.get("stop_reason") == "budget spent":
        return f"cut short by the budget after {len(block.get('points') or [])} points"
    left = block.get("skipped_for_budget_ms") if name == "slo" else block.get("skipped_for_budget") if name == "micro" \
        else None
    if left:
        what = "bounds " + ", ".join(f"{b:g} ms" for b in left) if name == "slo" else ", ".join(left)
        return f"cut short by the budget: {what} not run"
    return None


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
