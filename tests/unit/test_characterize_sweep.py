"""The closed-loop sweep of a characterization, its points measured by a stand-in for querygen: where it
stops and what its stop reason says."""

from __future__ import annotations

from typing import Any

import pytest

from recpipe.characterize import compare, document, report, sections, settings
from recpipe.characterize.sections import Chain, Counters, Measured
from recpipe.characterize.settings import QUICK, Settings
from recpipe.config import STEPS

SETTINGS = Settings(quick=True, sizes=QUICK, data="D", models="M", data_scale=None, data_seed=None,
                    dataset_sha256=None, device="cpu", generator_processes=1)
CHAIN = Chain(gateway="127.0.0.1:58001", pids={}, addresses={})


def point(rate: float, p99_ms: float, queries: int = 1000, errors: int = 0, **by_code: int) -> dict[str, Any]:
    """A querygen document as a closed-loop point left it (only what the sweep reads)."""
    e2e = {"p50_us": p99_ms * 500, "p99_us": p99_ms * 1000, "mean_us": p99_ms * 600, "count": queries}
    return {"achieved_rate": rate, "queries": queries, "ok": queries - errors, "errors": errors,
            "errors_by_code": by_code, "warmup_queries": 10, "end_to_end": e2e, "end_to_end_all": e2e,
            "stages": {st: {"p50_us": 100.0, "p99_us": 200.0} for st in STEPS}, "attribution": {}}


def sweep(monkeypatch: pytest.MonkeyPatch, *docs: dict[str, Any]) -> dict[str, Any]:
    """The sweep section over ``docs``, one per point in turn (1, 2, 4 clients)."""
    left = list(docs)
    none = Counters({}, {})

    def measure(ch: Chain, config: Any) -> Measured:
        return Measured(left.pop(0), {"querygen": 0.001}, {}, {}, none, none)

    monkeypatch.setattr(sections, "_measure", measure)
    monkeypatch.setattr(sections, "say", lambda message: None)
    return sections.sweep_section(SETTINGS, CHAIN, lambda: 60.0)


def test_a_sweep_stopped_by_its_points_failed_queries_says_so_not_that_p99_passed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the second point's queries were mostly refused: each counts until its 10 s deadline, past the bound
    got = sweep(monkeypatch, point(500.0, 9.0), point(60.0, 10_002.4, 1442, 1364, RESOURCE_EXHAUSTED=1300,
                                                        DEADLINE_EXCEEDED=64))
    assert got["stop_reason"] == ("1,364 of 1,442 queries failed at 2 clients (DEADLINE_EXCEEDED 64, "
                                  "RESOURCE_EXHAUSTED 1,300), more than the 1% a point may fail")
    assert "p99" not in got["stop_reason"] and len(got["points"]) == 2
    assert settings.stopped_for_failures(got["stop_reason"])
    # a sweep its failures stopped was not stopped by its p99 bound: another bound compares alike
    other = {"sizes": {**SETTINGS.to_json()["sizes"], "sweep_p99_ms": 200.0}}
    docs = [{"settings": {**SETTINGS.to_json(), **s}, "sections": {"sweep": got}} for s in ({}, other)]
    assert compare.differences(*docs) == []


def test_a_p99_stop_stays_one_and_a_few_failed_queries_do_not_stop_the_sweep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    got = sweep(monkeypatch, point(500.0, 9.0, errors=1), point(900.0, 600.0))  # 1 of 1,000: within 1%
    assert got["stop_reason"] == f"p99 600.00 ms passed the {QUICK.sweep_p99_ms:g} ms bound"
    assert not settings.stopped_for_failures(got["stop_reason"])
    got = sweep(monkeypatch, point(500.0, 9.0), point(900.0, 600.0, errors=5))
    assert got["stop_reason"].endswith("bound (5 of 1,000 queries failed)")
    assert settings.stopped_for_failures("reached 4 clients") is False


def test_a_sweep_says_how_it_counted_its_failed_queries_without_a_sequential_section(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The report reads how a sweep counted its failed queries from the sweep block itself (``counts``, written
    with it), not from whether the sequential section holds ``end_to_end_all``: that section may not have run."""
    got = sweep(monkeypatch, point(500.0, 9.0, errors=3), point(900.0, 600.0))
    assert got["counts"]["latency"] == document.EVERY_QUERY
    doc = {"settings": SETTINGS.to_json(), "sections": {"sweep": got}}
    assert report.failures(doc, "sweep", [("1 client", got["points"][0])]) == (
        "3 of 1,000 at 1 client (each counts in p50/p99 as unanswered until its deadline at least, and not in q/s).")
    # a document from before the field: the sequential section still tells it, as it always did
    old = {**got}
    del old["counts"]
    for seq, said in (({"end_to_end_all": {}}, "each counts in p50/p99 as unanswered"),
                      ({}, "p50/p99 leave them out (a document from before failed queries were counted)")):
        text = report.failures({"sections": {"sweep": old, "sequential": seq}}, "sweep", [("1 client", old["points"][0])])
        assert said in text


def test_the_client_counts_of_two_runs_on_the_curve_do_not_overlap() -> None:
    """Two runs' 1- and 2-client points sit close together (both light load): their labels must not be
    written over each other, as they were at one fixed offset from each point."""
    import json
    from pathlib import Path

    old = json.loads((Path(__file__).parent.parent / "data" / "characterization_h200_03a97ac.json").read_text())
    other = json.loads(json.dumps(old))
    for p in other["sections"]["sweep"]["points"]:  # a run a shade faster: its points just right of and below
        p.update(throughput=p["throughput"] * 1.03, p99_us=p["p99_us"] * 0.97)
    fig = report.curve_figure([("a", old), ("b", other)])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t for t in fig.axes[0].texts if t.get_text().isdigit()]
    assert sorted(t.get_text() for t in labels) == sorted(["1", "2", "4", "8", "16"] * 2)
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
    overlapping = [(a, b) for i, (a, x) in enumerate(boxes) for b, y in boxes[i + 1:] if x.overlaps(y)]
    assert overlapping == []
