"""The slowest queries' time by stage (recpipe.querygen.attribution): the split of one query, the bands,
exact merges, and the lines of the run table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recpipe.config import STEPS, TOTAL_STEP
from recpipe.querygen.attribution import PARTS, TailSplit, split_row
from recpipe.querygen.recorder import Recorder, merge
from recpipe.querygen.table import ATTRIBUTION_MIN_QUERIES, attribution_lines


def _timings(server: float, hop: float, gateway: float, batch: int = 2) -> dict[str, tuple[float, float, int]]:
    """Every stage ``server`` us inside, ``hop`` us more as observed; the handler ``gateway`` us beyond."""
    t = {s: (server, server + hop, batch) for s in STEPS}
    t[TOTAL_STEP] = (len(STEPS) * (server + hop) + gateway, 0.0, 0)
    return t


def test_a_query_splits_into_parts_that_sum_to_its_end_to_end_time() -> None:
    row = split_row(10_000.0, _timings(server=1000.0, hop=500.0, gateway=300.0))
    parts = dict(zip(PARTS, row[1:], strict=True))
    assert parts["gateway"] == 300.0 and parts["client"] == 10_000.0 - 6300.0
    for s in STEPS:
        assert (parts[f"{s}.server"], parts[f"{s}.hop"], parts[f"{s}.batch"]) == (1000.0, 500.0, 2.0)
    # (the send lag is inside the client's part, not beside it)
    assert sum(v for k, v in parts.items() if not k.endswith((".batch", ".send_lag"))) == pytest.approx(row[0])
    # without the gateway's total (a --per-component run), the client holds what the stages leave
    alone = split_row(7000.0, {s: (1000.0, 1500.0, 0) for s in STEPS})
    assert alone[1:3] == (1000.0, 0.0)


def _rows(n: int) -> list[tuple[float, ...]]:
    """Query i takes (i + 1) ms, of which its rank server time is i x 100 us more than the others'."""
    return [split_row(1000.0 * (i + 1), {**_timings(100.0, 50.0, 10.0),
                                         "rank": (100.0 + 100.0 * i, 150.0 + 100.0 * i, 1 + i % 3),
                                         TOTAL_STEP: (600.0 + 100.0 * i + 10.0, 0.0, 0)})
            for i in range(n)]


def test_the_slowest_band_holds_the_slowest_queries_and_their_parts() -> None:
    split = TailSplit.of(_rows(1000))
    assert split.queries == 1000
    tail = split.band(99.0, 100.0)
    assert tail is not None and tail["queries"] == 10
    # queries 990..999: end to end 991..1000 ms (2% buckets put the edge within a query or two)
    assert tail["end_to_end_us"] == pytest.approx(995_500, rel=0.003)
    assert tail["stages"]["rank"]["server_us"] == pytest.approx(100 + 100 * 994.5, rel=0.003)
    assert tail["stages"]["augment_user"] == {"server_us": 100.0, "hop_us": 50.0, "batch_size": 2.0}
    assert tail["gateway_us"] == pytest.approx(10.0)
    parts = (tail["client_us"] + tail["gateway_us"]
             + sum(st["server_us"] + st["hop_us"] for st in tail["stages"].values()))
    assert parts == pytest.approx(tail["end_to_end_us"], rel=1e-6)
    median = split.band(45.0, 55.0)
    assert median is not None and median["queries"] == 100
    assert median["end_to_end_us"] == pytest.approx(500_500, rel=0.01)
    assert TailSplit().band(99.0, 100.0) is None


def test_splits_merge_exactly_and_cross_a_pipe() -> None:
    rows = _rows(600)
    whole = TailSplit.of(rows)
    halves = TailSplit.of(rows[::2])
    halves.add(TailSplit.from_wire(TailSplit.of(rows[1::2]).to_wire()))
    assert halves.bands() == whole.bands()
    assert sorted(halves.buckets) == sorted(whole.buckets)
    for b, s in whole.buckets.items():
        np.testing.assert_allclose(halves.buckets[b], s)


def test_the_recorder_keeps_each_answered_query_split_through_a_merge() -> None:
    parts = []
    for k in range(2):
        rec = Recorder(measure_from=0.0)
        for i in range(300):
            timings = [(s, 1000.0, 1500.0, 10.0, 990.0, 4) for s in STEPS] + [(TOTAL_STEP, 6100.0, 6100.0)]
            rec.ok(1.0 + i, 1.0 + i, 1.0 + i + 0.007 + k * 0.001, timings)
        rec.error(0.5, 0.5, 0.6, "UNAVAILABLE")  # an error has no split
        parts.append(rec.finish())
    m = merge(parts)
    assert m.split.queries == 600 == m.ok
    median = m.split.band(45.0, 55.0)
    assert median is not None
    assert median["gateway_us"] == pytest.approx(100.0) and median["stages"]["rank"]["batch_size"] == 4.0
    assert median["end_to_end_us"] == pytest.approx(7500.0, rel=0.1)


def _doc(ok: int) -> dict[str, object]:
    return {"ok": ok, "attribution": TailSplit.of(_rows(ok)).bands()}


def test_the_table_compares_the_median_and_the_slowest_one_percent() -> None:
    lines = attribution_lines(_doc(ATTRIBUTION_MIN_QUERIES))
    text = "\n".join(lines)
    assert "the median queries against the slowest 1%" in text
    median = next(line for line in lines if line.startswith("p45-p55 (100)"))
    tail = next(line for line in lines if line.startswith("slowest 1% (10)"))
    assert float(median.split()[-1]) == pytest.approx(500.5, rel=0.01)
    assert float(tail.split()[-1]) == pytest.approx(995.5, rel=0.003)
    assert "mean batch size, median -> slowest 1%: augment_user 2.0 -> 2.0" in text
    assert all(len(line) <= 110 for line in lines)
    # a run too small for its slowest 1% to mean anything gets no such table
    assert attribution_lines(_doc(ATTRIBUTION_MIN_QUERIES - 1)) == []
    assert attribution_lines({"ok": 5000}) == []
    # lone queries everywhere: no batch-size line
    lone = {"ok": 1000, "attribution": TailSplit.of([split_row(1000.0 * (i + 1), _timings(100.0, 50.0, 10.0, batch=1))
                                                     for i in range(1000)]).bands()}
    assert not any("batch size" in line for line in attribution_lines(lone))


def test_a_characterization_report_names_the_slowest_one_percents_largest_parts() -> None:
    from recpipe.characterize import report

    bands = TailSplit.of(_rows(1000)).bands()
    line = report._tail_line("At the sweep's peak (8 clients)", bands)[0]
    assert line.startswith("At the sweep's peak (8 clients), the slowest 1% of queries (10, 994.00 ms end to end")
    # the three largest parts, largest first: the client's, then rank's (server + hop), then a stage's
    assert "spent most in: client 894.09, rank 99.45 (server 99.40 + hop 0.050), augment_user 0.150" in line
    # too few queries in the slowest 1%, or a document from before the split: nothing
    assert report._tail_line("Sequential", TailSplit.of(_rows(400)).bands()) == []
    assert report._tail_line("Sequential", None) == []


def test_an_slo_search_keeps_both_sides_of_its_knee_and_the_report_says_where_their_time_went() -> None:
    from recpipe.characterize import report
    from recpipe.characterize.sections import _knee_attribution

    bands = {r: TailSplit.of(_rows(1000)).bands() for r in (100.0, 200.0, 150.0, 175.0)}
    curve = [{"target_rate": 100.0, "meets_slo": True}, {"target_rate": 150.0, "meets_slo": True},
             {"target_rate": 175.0, "meets_slo": False}, {"target_rate": 200.0, "meets_slo": False}]
    knee = _knee_attribution(150.0, curve, bands)["knee"]
    assert knee["met"]["rate"] == 150.0 and knee["missed"]["rate"] == 175.0
    assert knee["met"]["attribution"] == bands[150.0]
    # nothing met the bound: only the lowest rate that missed; nothing missed: only the highest that met
    assert _knee_attribution(None, curve[2:], bands)["knee"] == {"met": None, "missed": {"rate": 175.0,
                                                                                            "attribution": bands[175.0]}}
    assert _knee_attribution(150.0, curve[:2], bands)["knee"]["missed"] is None
    # on a real characterization (the H200 reference, from before the split was kept: no such lines)
    doc = json.loads((Path(__file__).parents[1] / "data" / "characterization_h200_03a97ac.json").read_text())
    assert not [line for line in report.markdown(doc, charts=()).splitlines() if "slowest 1%" in line]
    search = doc["sections"]["slo"]["searches"][0]
    search.update(p99_bound_ms=20.0, max_rate=150.0, curve=curve, knee=knee)
    lines = [line for line in report.markdown(doc, charts=()).splitlines() if "slowest 1%" in line]
    assert [line.split(",")[0:2] for line in lines] == [["p99 <= 20 ms", " at 150.0 q/s (the highest that met it)"],
                                                         ["p99 <= 20 ms", " at 175.0 q/s (the lowest above it that missed)"]]


def test_the_slo_table_gives_the_queries_at_each_knee_and_flags_a_thin_one() -> None:
    from recpipe.characterize import report

    doc = json.loads((Path(__file__).parents[1] / "data" / "characterization_h200_03a97ac.json").read_text())
    lines = report.markdown(doc, charts=()).splitlines()
    assert "| 20 | 528.7 | 6 | 2644 / 2758 |" in lines and "| 50 | 666.6 | 6 | 3333 / 3448 |" in lines
    # nothing met 10 ms: its lowest step, 115 queries, is a p99 from about one query beyond it
    assert "| 10 | none met | 5 | - / 115 |" in lines
    note = [line for line in lines if line.startswith("A knee step under 1,000 queries")]
    assert len(note) == 1
    # without the thin search, no note; a curve from before steps kept their counts shows "-"
    searches = doc["sections"]["slo"]["searches"]
    doc["sections"]["slo"]["searches"] = searches[1:]
    assert not any(line.startswith("A knee step") for line in report.markdown(doc, charts=()).splitlines())
    for step in searches[1]["curve"]:
        del step["queries"]
    assert "| 20 | 528.7 | 6 | - / - |" in report.markdown(doc, charts=()).splitlines()


def test_the_client_part_says_how_much_of_it_was_the_generator_sending_late() -> None:
    # 1,000 answered queries of 10 ms; the 10 slowest took 300 ms, all of it before the gateway's handler
    # ran: 5 because the generator sent them 290 ms late, 5 sent on time into a frozen gateway. Both read
    # as client time; the send lag says which was which.
    rec = Recorder(measure_from=0.0)
    for i in range(1000):
        t = i * 0.01
        slow, late = i % 100 == 0, i % 200 == 0
        sent = t + (0.29 if late else 0.0)
        done = t + (0.3 if slow else 0.01)
        rec.ok(t, sent, done, [(s, 1000.0, 1500.0) for s in STEPS] + [(TOTAL_STEP, 6100.0, 6100.0)])
    bands = rec.finish().split.bands()
    tail, median = bands["p99"], bands["median"]
    assert tail is not None and median is not None and tail["queries"] == 10
    assert tail["client_us"] == pytest.approx(300_000 - 6100, rel=1e-3)
    assert tail["send_lag_us"] == pytest.approx(145_000, rel=1e-3)  # half of them, 290 ms each
    assert median["send_lag_us"] == 0.0
    text = " ".join(line.strip() for line in attribution_lines({"ok": 1000, "attribution": bands}))
    assert "the generator's send lag (sent after its scheduled instant): median 0.000, slowest 1% 145.000 ms" in text
