"""A p99 from fewer than 100 queries is the slowest of them, not a percentile: characterize's report and its
comparison mark it ``*`` (with the footnote), as ``recpipe report`` marks it on querygen runs and the curve
rings it, in the sequential table (a --quick run's 40 queries) as in the sweep's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recpipe.characterize import compare, report

OLD = Path(__file__).parent.parent / "data" / "characterization_h200_03a97ac.json"
NOTE = "\\* from fewer than 100 queries: a p99 there is the slowest of them, not a percentile (run more queries)."


def _quick() -> dict[str, Any]:
    """The reference document as a --quick run would have measured it: 40 sequential queries, a 1 s sweep point."""
    doc = json.loads(OLD.read_text())
    seq = doc["sections"]["sequential"]
    for b in (*seq["stages"].values(), seq["end_to_end"]):
        b["count"] = 40
    seq["queries"] = 40
    doc["sections"]["sweep"]["points"][0]["queries"] = 56
    return doc


def _row(text: str, start: str) -> list[str]:
    line = next(row for row in text.splitlines() if row.startswith(start))
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_report_marks_a_sequential_and_a_sweep_p99_from_fewer_than_100_queries() -> None:
    full, quick = json.loads(OLD.read_text()), _quick()
    text = report.markdown(quick, charts=())
    seq = text.split("## Sequential per-stage latency")[1].split("## Closed-loop")[0]
    assert _row(seq, "| **end to end** |")[2].endswith("*") and _row(seq, "| rank |")[2].endswith("*")
    assert not _row(seq, "| rank |")[1].endswith("*")  # p50 needs 2 queries
    assert NOTE in seq
    sweep = text.split("## Closed-loop concurrency sweep")[1]
    assert _row(sweep, "| 1 |")[3].endswith("*") and not _row(sweep, "| 2 |")[3].endswith("*")
    assert NOTE in sweep
    # 500 sequential queries and full sweep points: nothing marked, no footnote
    assert "*" not in "".join(_row(report.markdown(full), "| **end to end** |")[1:]) and NOTE not in report.markdown(full)


def test_the_comparison_marks_them_and_the_speed_ups_that_rest_on_them() -> None:
    full, quick = json.loads(OLD.read_text()), _quick()
    text = compare.markdown([("a", full), ("b", quick)])
    seq = text.split("## Sequential per-stage latency")[1].split("Where the time goes")[0]
    cells = _row(seq, "| **end to end** |")[1:]  # a p50, a p99, b p50, b p99, b speed-up p50, b speed-up p99
    assert [c.endswith("*") for c in cells] == [False, False, False, True, False, True]
    assert NOTE in seq
    sweep = text.split("## Closed-loop concurrency sweep")[1].split("## SLO")[0]
    assert _row(sweep, "| 1 |")[4].endswith("*") and NOTE in sweep
    assert NOTE not in compare.markdown([("a", full), ("b", full)])
