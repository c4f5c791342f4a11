"""Every chart drawn from a fixed run document (tests/data/*.json): valid PNGs, titled axes, plain
log ticks with the SLO ticked, every line in the legend, no percentile beyond what the sample supports,
and the end-to-end label at its line. (Looking at them stays a person's job.)"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from recpipe.cli import main
from recpipe.querygen import plots

DATA = Path(__file__).resolve().parents[1] / "data"


def _load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DATA / name).read_text())
    return doc


@pytest.fixture(scope="module")
def seq() -> dict[str, Any]:
    return _load("run_sequential_300.json")


@pytest.fixture(scope="module")
def slo() -> dict[str, Any]:
    return _load("run_open_slo_5000.json")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300 and height > 200
    return width, height


def _ticks(ax: Any, which: str) -> list[str]:
    ax.figure.canvas.draw()
    labels = ax.get_xticklabels() if which == "x" else ax.get_yticklabels()
    return [t.get_text() for t in labels if t.get_text()]


def _titled(fig: Any, *words: str) -> None:
    title = fig.get_suptitle()
    for w in words:
        assert w in title, (w, title)
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel(), ax


def _plain_numbers(labels: list[str]) -> None:
    assert labels and all(lb.replace(",", "").replace(".", "", 1).isdigit() for lb in labels), labels


def test_ladder_is_1_2_5_and_plain() -> None:
    assert plots.ladder(7.5, 18.0) == [7.0, 10.0, 15.0, 20.0]  # too narrow for 1-2-5: 1-1.5-2-3-5-7
    assert plots.ladder(0.3, 40) == [0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0]


def test_run_charts_are_pngs(seq: dict[str, Any], slo: dict[str, Any], tmp_path: Path) -> None:
    paths = plots.write_run_plots(seq, tmp_path / "seq") + plots.write_run_plots(slo, tmp_path / "slo")
    assert sorted(p.name for p in paths) == ["latency_cdf.png", "latency_cdf.png", "slo_curve.png",
                                              "stage_latency.png", "stage_latency.png"]
    for p in paths:
        _png_size(p)


def test_cdf_cuts_what_the_sample_cannot_support(seq: dict[str, Any]) -> None:
    fig = plots.latency_cdf_figure([("", seq)])
    _titled(fig, "sequential", "300 queries", "cpu", "2026-11-20")
    cdf, tail = fig.axes
    _plain_numbers(_ticks(cdf, "x"))
    _plain_numbers(_ticks(tail, "y"))
    # 300 samples support p99 (100 needed) but not p99.9 (1,000): the tail stops at p99.
    assert _ticks(tail, "x") == ["p50", "p90", "p99"]
    drawn = [p for p, _ in plots.supported_cdf(seq)[0]]
    assert max(drawn) == 99.5 and 99.9 not in drawn
    legend = [t.get_text() for t in cdf.get_legend().get_texts()]
    assert legend == ["end to end (no p99.9: 300 queries, it needs 1,000)"]


def test_cdf_legends_sit_under_their_axes(seq: dict[str, Any]) -> None:
    """A tail of failed queries fills the top of the tail panel and the bottom of the CDF: a legend
    inside either could cover the curve, so both sit below their axes."""
    fig = plots.latency_cdf_figure([("a", seq), ("b", seq)])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.y1 < ax.get_window_extent(renderer).y0, ax.get_title()


def test_slo_curve_ticks_the_slo_and_names_every_line(slo: dict[str, Any]) -> None:
    fig = plots.slo_curve_figure([("", slo)])
    _titled(fig, "open", "5,000 queries", "cpu", "2026-11-21")
    (ax,) = fig.axes
    ticks = _ticks(ax, "y")
    _plain_numbers(ticks)
    assert "50" in ticks and "10" in ticks
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "SLO: p99 <= 50 ms" in legend and any(t.startswith("max rate meeting the SLO: 100.0") for t in legend)
    assert "p99 per step" in legend and "p50 per step" in legend
    assert "p99 from < 100 queries (not supported)" in legend  # the 10 q/s step had 50 queries
    assert len(legend) == len(ax.get_legend().legend_handles)


def test_an_slo_off_the_1_2_5_ladder_is_ticked_too(slo: dict[str, Any]) -> None:
    doc = {**slo, "slo": {**slo["slo"], "slo_p99_ms": 35.0}}
    (ax,) = plots.slo_curve_figure([("", doc)]).axes
    ticks = _ticks(ax, "y")
    assert "35" in ticks and "50" in ticks and "20" in ticks


def test_stage_bars_label_end_to_end_at_its_line(seq: dict[str, Any], slo: dict[str, Any]) -> None:
    fig = plots.stage_bars_figure([("a", seq), ("b", slo)])
    _titled(fig, "a: sequential", "b: open")
    (ax,) = fig.axes
    labels = {t.get_text(): t.get_position()[1] for t in ax.texts}
    for doc in (seq, slo):
        for key in ("p50_us", "p99_us"):
            e2e = doc["end_to_end"][key] / 1000
            assert labels[f"{e2e:.2f}"] == pytest.approx(e2e)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:1] == ["end to end"] and legend[1:5] == ["augment_user", "retrieve", "augment_items", "rank"]
    assert any(t.startswith("hatched: queued") for t in legend)  # run b reports the queue/compute split


def test_comparison_bars_in_chain_order(seq: dict[str, Any], slo: dict[str, Any]) -> None:
    fig = plots.comparison_bars_figure([("a", seq), ("b", slo)])
    for ax in fig.axes:
        assert _ticks(ax, "x") == ["augment user", "retrieve", "augment items", "rank", "end to end"]
        assert ax.get_xlabel() and ax.get_ylabel()


def test_report_refuses_unlike_runs_unless_forced(seq: dict[str, Any], slo: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "seq.json", tmp_path / "open.json"
    a.write_text(json.dumps(seq))
    b.write_text(json.dumps(slo))
    out = tmp_path / "report"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mode 'sequential' vs 'open'" in err[0] and "--force" in err[0]
    assert not out.exists()
    assert main(["report", str(a), str(b), "--out", str(out), "--force"]) == 0
    md = (out / "report.md").read_text()
    assert "**Warning: these runs differ in mode or workload" in md
    stage_rows = [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ")
                  and line.split("|")[1].strip() in ("augment_user", "retrieve", "augment_items", "rank")]
    assert stage_rows[:4] == ["augment_user", "retrieve", "augment_items", "rank"]
    assert "open queue p50" in md  # the open run reports the queue/compute split
    for png in ("comparison.png", "stages.png", "latency_cdf.png"):
        _png_size(out / png)
