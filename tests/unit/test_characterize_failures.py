"""Failed queries in the sweep and the SLO steps: the report says how many failed where, and how its p50/p99
count them, instead of a bare p50 of 10 s (each failed query counts until its deadline)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from recpipe.characterize import compare, report

OLD = Path(__file__).parent.parent / "data" / "characterization_h200_03a97ac.json"


def _failing() -> dict[str, Any]:
    """A document as ``--serve-arg=--max-in-flight=1`` left it: most queries of 16 clients refused."""
    doc = json.loads(OLD.read_text())
    sec = doc["sections"]
    sec["sequential"]["end_to_end_all"] = sec["sequential"]["end_to_end"]  # a document that counts failures
    point = sec["sweep"]["points"][-1]
    point.update(errors=1364, queries=1442, p50_us=10_002_431, p99_us=10_002_431)
    sec["slo"]["searches"][0]["curve"][0].update(errors=40, queries=130)
    return doc


def test_the_report_names_the_failed_queries_of_sweep_points_and_slo_steps() -> None:
    doc = _failing()
    text = report.markdown(doc)
    assert ("**Failed queries:** 1,364 of 1,442 at 16 clients (each counts in p50/p99 as unanswered until its "
            "deadline at least, and not in q/s).") in text
    step = doc["sections"]["slo"]["searches"][0]["curve"][0]
    assert f"**p99 <= 10 ms, failed queries:** 40 of 130 at {step['target_rate']:.1f} q/s" in text
    assert "; 1,364 queries failed" in report.summary(doc)
    # a document from before failed queries were counted says its latencies leave them out
    del doc["sections"]["sequential"]["end_to_end_all"]
    assert "p50/p99 leave them out" in report.markdown(doc)


def test_the_comparison_names_each_runs_failed_sweep_points() -> None:
    good, bad = json.loads(OLD.read_text()), _failing()
    text = compare.markdown([("a", good), ("b", copy.deepcopy(bad))])
    assert "- b's failed queries: 1,364 of 1,442 at 16 clients" in text and "- a's failed queries" not in text
    assert "Failed queries" not in report.markdown(good)


def test_the_curve_marks_failed_points_and_thin_p99s_on_a_log_axis_with_the_sweeps_bound() -> None:
    doc = _failing()
    doc["sections"]["sweep"]["points"][0]["queries"] = 56  # a quick run's 1 s at one client: its p99 is its slowest
    ax = report.curve_figure([("", doc)]).axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert ax.get_yscale() == "log"  # the failed point's 10 s would flatten the others on a linear axis
    assert "point with failed queries (each counted until its deadline)" in labels
    assert "p99 from < 100 queries (not supported)" in labels
    assert "sweep's p99 bound: 200 ms" in labels
    assert ax.get_ylim()[1] > 10_002 and ax.get_ylim()[0] < 8  # the failed point and the fastest p50 both shown


def test_sequential_end_to_end_reads_every_query_in_the_report_and_the_comparison() -> None:
    """A sequential run whose queries failed shows their tail (``end_to_end_all``), as the sweep and the SLO
    steps do; the answered queries alone would read faster."""
    good, doc = json.loads(OLD.read_text()), _failing()
    seq = doc["sections"]["sequential"]
    seq["end_to_end_all"] = {**seq["end_to_end"], "p50_us": 7_000.0, "p99_us": 10_000_000.0}
    assert "| **end to end** | 7.00 | 10000.00 |" in report.markdown(doc)
    assert "end to end 7.00 (p99 10000.00)" in report.summary(doc)
    text = compare.markdown([("a", good), ("b", doc)])
    assert "10000.00" in text
