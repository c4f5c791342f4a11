"""`recpipe report`: runs side by side with per-stage speed-ups (documents built from real recorders)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_support import one_line_exit_2

from recpipe.cli import main
from recpipe.config import STEPS
from recpipe.querygen import compare, plots
from recpipe.querygen.output import FORMAT
from recpipe.querygen.recorder import Recorder
from recpipe.querygen.session import FORMAT_VERSION, summarise


def _run_doc(stage_ms: dict[str, float], seed: int, gpu: str = "none") -> dict[str, Any]:
    """A run document whose stages take ``stage_ms`` each (+-2% jitter), recorded like a real run."""
    rng = np.random.default_rng(seed)
    rec = Recorder(measure_from=0.0)
    t = 0.0
    for _ in range(2000):
        # server time, and 0.1 ms more as observed by the caller
        timings = [(s, us, us + 100) for s in STEPS
                   for us in [int(stage_ms[s] * 1000 * rng.uniform(0.98, 1.02))]]
        total = sum(observed for _, _, observed in timings) / 1e6 + 0.0005
        rec.ok(t, t, t + total, timings)
        t += 0.01
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "mode": "sequential", "per_component": False,
           "target_rate": None, "achieved_rate": 100.0, "platform": {"cpu": "test cpu", "cores": 2, "gpu": gpu},
           "pipeline": {"gateway": {"device": "cpu"}}, "model_version": "v1"}
    doc.update(summarise(rec.finish()))
    return doc


BASE = {"augment_user": 1.0, "retrieve": 4.0, "augment_items": 3.2, "rank": 10.0}
FAST = {"augment_user": 1.0, "retrieve": 2.0, "augment_items": 2.0, "rank": 5.0}


def _ratios(line: str) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(r"(\w+) (\d+\.\d+)x", line)}


def _expected(stage: str) -> float:
    return (BASE[stage] + 0.1) / (FAST[stage] + 0.1)


def test_speedups_per_stage_and_end_to_end() -> None:
    a, b = _run_doc(BASE, 1), _run_doc(FAST, 2, gpu="H100")
    line = compare.verdict("B", a, b)
    assert line.startswith("B is ") and "faster end to end (p50)" in line
    e2e = float(line.split(" is ")[1].split("x")[0])
    assert e2e == pytest.approx((sum(BASE.values()) + 0.9) / (sum(FAST.values()) + 0.9), rel=0.03)
    ratios = _ratios(line)
    for stage in STEPS:
        assert ratios[stage] == pytest.approx(_expected(stage), rel=0.03), stage
    slower = compare.verdict("A", b, a)
    assert "slower end to end" in slower
    assert _ratios(slower)["rank"] == pytest.approx(1 / _expected("rank"), rel=0.03)
    md = compare.markdown([("A", a), ("B", b)])
    assert "| **end to end** (client) |" in md and "| gpu | none | H100 |" in md
    assert sum(line.startswith("- B is") for line in md.splitlines()) == 2
    # where each run's median and slowest 1% of queries spent their time
    assert "| part | A median | A slowest 1% | B median | B slowest 1% |" in md
    rank = next(line for line in md.splitlines() if line.startswith("| rank server |"))
    cells = [float(c) for c in rank.strip("|").split("|")[1:]]
    assert cells[0] == pytest.approx(BASE["rank"], rel=0.03) and cells[2] == pytest.approx(FAST["rank"], rel=0.03)
    assert "| rank hop | 0.100 | 0.100 | 0.100 | 0.100 |" in md
    assert "| queries | 200 | 20 | 200 | 20 |" in md
    # a run written before the parts were kept has none; the report leaves the table out
    assert compare.attribution_table([("A", {k: v for k, v in a.items() if k != "attribution"})]) == []


def test_speedup_ignores_timer_noise() -> None:
    assert compare.speedup(3, 1) is None and compare.speedup(0, 100) is None
    assert compare.speedup(200, 100) == 2.0


def _write(tmp_path: Path, name: str, doc: dict[str, Any]) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def test_report_command_writes_markdown_and_charts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path, "x86.json", _run_doc(BASE, 1))
    b = _write(tmp_path, "gh200.json", _run_doc(FAST, 2))
    out = tmp_path / "report"
    assert main(["report", a, b, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gh200 is " in printed
    assert _ratios(printed.split("- gh200 is ")[1])["rank"] == pytest.approx(_expected("rank"), rel=0.03)
    assert (out / "report.md").read_text() == printed
    for png in ("comparison.png", "stages.png", "latency_cdf.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # Not overwritten without --force; with it, fine.
    assert main(["report", a, b, "--out", str(out)]) == 2
    assert main(["report", a, b, "--out", str(out), "--force", "--labels", "x86,gh"]) == 0
    assert "gh is " in (out / "report.md").read_text()


@pytest.mark.parametrize("content", ["not json", json.dumps({"format": "other"}),
                                     json.dumps({"format": FORMAT, "format_version": 99})])
def test_report_rejects_what_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          content: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["report", str(bad), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json" in err[0]


def test_report_label_count_must_match(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", _run_doc(BASE, 1))
    assert main(["report", a, "--out", str(tmp_path / "r"), "--labels", "x,y"]) == 2
    assert main(["report", str(tmp_path / "missing.json"), "--out", str(tmp_path / "r")]) == 2


def test_report_files_follow_the_umask(tmp_path: Path) -> None:
    import os
    import stat

    a = _write(tmp_path, "x86.json", _run_doc(BASE, 1))
    b = _write(tmp_path, "gh200.json", _run_doc(FAST, 2))
    out = tmp_path / "report"
    previous = os.umask(0o022)
    try:
        assert main(["report", a, b, "--out", str(out)]) == 0
    finally:
        os.umask(previous)
    for name in ("report.md", "comparison.png", "stages.png", "latency_cdf.png"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name


@pytest.mark.parametrize(("labels", "match"), [(",", "leaves a run without a name"), ("a, ", "without a name"),
                                               ("a,a", "names two runs the same"), ("a|b,c", "holds '|'")])
def test_report_refuses_labels_that_would_break_its_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           labels: str, match: str) -> None:
    a = _write(tmp_path, "a.json", _run_doc(BASE, 1))
    b = _write(tmp_path, "b.json", _run_doc(FAST, 2))
    one_line_exit_2(capsys, ["report", a, b, "--out", str(tmp_path / "r"), "--labels", labels], match)
    assert not (tmp_path / "r").exists()


def test_report_refuses_a_file_name_that_would_break_its_tables(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path, "x|y.json", _run_doc(BASE, 1))
    one_line_exit_2(capsys, ["report", a, "--out", str(tmp_path / "r")], "name the runs with --labels")
    assert main(["report", a, "--out", str(tmp_path / "r"), "--labels", "xy"]) == 0


@pytest.mark.parametrize(("out", "match"), [("/proc/x", "--out /proc/x: cannot create the directory"),
                                            ("a.json", "is not a directory")])
def test_report_refuses_an_out_it_cannot_write_before_drawing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              out: str, match: str) -> None:
    a = _write(tmp_path, "a.json", _run_doc(BASE, 1))
    one_line_exit_2(capsys, ["report", a, "--out", out if out.startswith("/") else str(tmp_path / out)], match)


def test_report_refuses_a_directory_where_a_file_goes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path, "a.json", _run_doc(BASE, 1))
    (tmp_path / "r" / "stages.png").mkdir(parents=True)
    one_line_exit_2(capsys, ["report", a, "--out", str(tmp_path / "r"), "--force"], "stages.png is a directory")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["stages.png"]  # nothing drawn before it


def test_report_interrupted_while_drawing_leaves_no_part_of_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recpipe.querygen import plots

    a = _write(tmp_path, "a.json", _run_doc(BASE, 1))
    b = _write(tmp_path, "b.json", _run_doc(FAST, 2))
    out = tmp_path / "r"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")

    def ctrl_c(*args: object) -> None:  # Ctrl-C while the third chart is drawn, the first two drawn
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "latency_cdf_figure", ctrl_c)
    assert main(["report", a, b, "--out", str(out)]) == 130
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # no charts without report.md, no temporaries
    monkeypatch.undo()
    assert main(["report", a, b, "--out", str(out)]) == 0  # and the rerun needs no --force
    assert sorted(p.name for p in out.iterdir()) == ["comparison.png", "latency_cdf.png", "notes.txt", "report.md",
                                                     "stages.png"]


def test_report_interrupted_leaves_no_directory_it_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recpipe.querygen import plots

    a = _write(tmp_path, "a.json", _run_doc(BASE, 1))

    def ctrl_c(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "stage_bars_figure", ctrl_c)
    assert main(["report", a, "--out", str(tmp_path / "new" / "r")]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_characterization_report_interrupted_while_drawing_leaves_no_part_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from recpipe.characterize import compare as char_compare

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    pair = [str(bench / n) for n in ("h200-cuda-03a97ac", "h200-cpu-03a97ac")]
    out = tmp_path / "r"
    out.mkdir()

    def ctrl_c(*args: object) -> None:  # after curves.png was drawn
        raise KeyboardInterrupt

    monkeypatch.setattr(char_compare, "stages_figure", ctrl_c)
    assert main(["report", *pair, "--out", str(out)]) == 130
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["report", *pair, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "report.md", "stages.png"]
    assert (out / "report.md").read_text(encoding="utf-8") == capsys.readouterr().out


def test_stage_devices_are_listed_in_chain_order_whatever_order_the_run_recorded() -> None:
    a, b = _run_doc(BASE, 1), _run_doc(FAST, 2)
    a["pipeline"] = {name: {"device": f"{name}-dev"} for name in ("gateway", "ranking", "features", "retrieval")}
    b["pipeline"] = {name: {"device": f"{name}-dev"} for name in ("retrieval", "gateway", "features", "ranking")}
    row = next(line for line in compare.markdown([("A", a), ("B", b)]).splitlines()
               if line.startswith("| stage devices |"))
    chain = "features: features-dev, retrieval: retrieval-dev, ranking: ranking-dev, gateway: gateway-dev"
    assert row == f"| stage devices | {chain} | {chain} |"


def _deadline_doc(answered_ms: float, failed_share: float, deadline_s: float) -> dict[str, Any]:
    """2,000 queries answered in ``answered_ms`` each, but every 1/``failed_share``-th one runs into its
    ``deadline_s`` and fails with DEADLINE_EXCEEDED there (recorded like a real run)."""
    rec = Recorder(measure_from=0.0)
    every = round(1 / failed_share) if failed_share else 0
    for i in range(2000):
        t = i * 0.01
        if every and i % every == 0:
            rec.error(t, t, t + deadline_s, "DEADLINE_EXCEEDED")
        else:
            rec.ok(t, t, t + answered_ms / 1000, [(s, answered_ms * 200, answered_ms * 250) for s in STEPS])
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "mode": "sequential", "per_component": False,
           "target_rate": None, "achieved_rate": 100.0, "platform": {"cpu": "test cpu", "cores": 2, "gpu": "none"},
           "pipeline": {"gateway": {"device": "cpu"}}, "model_version": "v1", "workload": {"timeout_s": deadline_s}}
    doc.update(summarise(rec.finish()))
    return doc


def test_a_run_whose_tail_ran_into_its_deadline_does_not_read_as_faster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A answers every query in 20 ms; B answers 97% in 10 ms and lets 3% wait 100 ms for nothing. Its
    # answered queries' p99 is 10 ms ("2x faster"), but 3% of its queries took 100 ms and failed.
    a, b = _deadline_doc(20.0, 0.0, 0.1), _deadline_doc(10.0, 0.03, 0.1)
    assert b["errors"] == 61 and b["end_to_end"]["p99_us"] < 10_100
    line = compare.verdict("B", a, b, "p99_us")
    assert "B is 5.00x slower end to end (p99)" in line, line
    md = compare.markdown([("A", a), ("B", b)])
    assert "**B: 61 of 2000 queries failed** (DEADLINE_EXCEEDED=61); end to end counts each as unanswered until its deadline" in md
    e2e = next(row for row in md.splitlines() if row.startswith("| **end to end** (client) |"))
    cells = [c.strip() for c in e2e.strip("|").split("|")][1:]
    assert [float(c) for c in cells[:4]] == pytest.approx([20.0, 20.0, 10.0, 100.0], rel=2e-3)  # 3 digits
    assert cells[4:] == ["2.00x", "0.20x"]  # B's p50 is faster; its p99 is the deadline
    # The latency CDF the report draws shows the same tail: B's p99 point is at its deadline.
    points = dict(plots.supported_cdf(b)[0])
    assert points[50.0] == pytest.approx(10.0, rel=2e-3) and points[99.0] == pytest.approx(100.0, rel=2e-3)
    # A run with another deadline is measured another way: every query slower than it fails there.
    c = _deadline_doc(20.0, 0.0, 10.0)
    one_line_exit_2(capsys, ["report", _write(tmp_path, "a.json", a), _write(tmp_path, "c.json", c),
                             "--out", str(tmp_path / "r")], "deadline (s) 0.1 vs 10.0")


def test_replayed_arrivals_and_poisson_are_unlike(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    poisson = {**_run_doc(BASE, 1), "mode": "open", "target_rate": 100.0, "workload": {"arrivals": None}}
    bursts = {**poisson, "workload": {"arrivals": {"file": "/a/bursts.txt", "intervals": 4, "mean_rate": 100.0}}}
    elsewhere = {**poisson, "workload": {"arrivals": {"file": "/b/bursts.txt", "intervals": 4, "mean_rate": 100.0}}}
    assert compare.differences(poisson, bursts) == ["arrivals Poisson vs replayed (4 intervals, mean 100.0 q/s)"]
    assert compare.differences(bursts, elsewhere) == []  # the same intervals, from another path
    one_line_exit_2(capsys, ["report", _write(tmp_path, "p.json", poisson), _write(tmp_path, "b.json", bursts),
                             "--out", str(tmp_path / "r")], "arrivals Poisson vs replayed")


def test_a_p99_from_fewer_than_100_queries_is_marked_in_the_report() -> None:
    def small(stage_ms: dict[str, float], seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        rec = Recorder(measure_from=0.0)
        for i in range(40):
            timings = [(s, int(stage_ms[s] * 1000 * rng.uniform(0.98, 1.02)), 0) for s in STEPS]
            rec.ok(i * 0.1, i * 0.1, i * 0.1 + sum(float(t[1]) for t in timings) / 1e6, timings)
        return {**_run_doc(stage_ms, seed), **summarise(rec.finish())}

    a, b = small(BASE, 1), small(FAST, 2)
    md = compare.markdown([("A", a), ("B", b)])
    e2e = next(row for row in md.splitlines() if row.startswith("| **end to end** (client) |"))
    cells = [c.strip() for c in e2e.strip("|").split("|")][1:]
    assert [c.endswith("*") for c in cells] == [False, True, False, True, False, True]
    assert "\\* from fewer than 100 queries: a p99 there is the slowest of them" in md
    assert "(from 40 queries: p99 needs 100)" in compare.verdict("B", a, b, "p99_us")
    assert "needs" not in compare.verdict("B", a, b, "p50_us")
