"""PNG charts of run documents (headless: matplotlib's Agg canvas, never pyplot or a display).

Each function takes one or more ``(label, run_doc)`` pairs, so ``recpipe report`` draws the same charts
for several runs side by side. Conventions every chart keeps:

- log axes carry plain-number ticks on a 1-2-5 ladder (0.5, 1, 2, 5, 10, 20, 50 ms ...), plus the SLO
  value where there is one, never matplotlib's 9x10^0 / 2x10^1 labels;
- every axis has a title, every drawn line is in the legend;
- the title names the mode, the query count, the device and the date;
- no percentile is drawn beyond what the sample supports (``recpipe.querygen.table.min_samples``: p99
  needs 100 samples, p99.9 about 1,000, p99.99 about 10,000); what was cut is said on the chart.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from recpipe.config import STEPS
from recpipe.files import write_atomic, write_files
from recpipe.querygen.table import min_samples, supported

Labelled = Sequence[tuple[str, dict[str, Any]]]

_COLORS = {"augment_user": "#4C72B0", "retrieve": "#DD8452", "augment_items": "#55A868", "rank": "#C44E52",
           "other": "#BBBBBB"}
#: the percentiles the tail panel may show, each only when the sample supports it
TAIL_TICKS = (50.0, 90.0, 99.0, 99.9, 99.99)


def _figure(width: float = 8.0, height: float = 4.5) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png(fig: Any) -> bytes:
    """``fig`` drawn as a PNG, in memory (written with the rest of its set: ``recpipe.files.write_files``)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def _save(fig: Any, path: Path, force: bool) -> Path:
    return write_atomic(path, png(fig), force=force)


def _plain(v: float) -> str:
    """1 -> "1", 0.5 -> "0.5", 2000 -> "2,000", 0.05 -> "0.05"."""
    if v >= 1000:
        return f"{v:,.0f}"
    return f"{v:g}"


def ladder(lo: float, hi: float) -> list[float]:
    """The 1-2-5 values that span [lo, hi] (one step beyond each end, so the data sits inside); a
    range too narrow for four of them gets the 1-1.5-2-3-5-7 ladder instead."""
    lo, hi = max(lo, 1e-3), max(hi, lo * 1.0001)
    for steps in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7)):
        out: list[float] = []
        for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
            out += [m * 10.0 ** e for m in steps]
        below = [v for v in out if v <= lo]
        above = [v for v in out if v >= hi]
        first = below[-1] if below else out[0]
        last = above[0] if above else out[-1]
        ticks = [round(v, 6) for v in out if first <= v <= last]
        if len(ticks) >= 4:
            break
    return ticks


def plain_log_axis(ax: Any, which: str, lo: float, hi: float, extra: Iterable[float] = ()) -> list[float]:
    """Log scale on ``which`` ("x" or "y") with 1-2-5 plain ticks covering [lo, hi] and ``extra`` ticks
    (e.g. the SLO) always shown; returns the ticks."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    extra = [float(v) for v in extra if v and v > 0]
    ticks = ladder(min([lo, *extra]), max([hi, *extra]))
    ticks = sorted(set(ticks) | set(extra))
    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: _plain(v)))
    axis.set_minor_locator(NullLocator())
    # a margin beyond the data where a tick ends right at it: a point at 99.6 sat on a frame at 100
    (ax.set_xlim if which == "x" else ax.set_ylim)(min(ticks[0], lo / 1.08), max(ticks[-1], hi * 1.08))
    return ticks


def _date(doc: dict[str, Any]) -> str:
    return str(doc.get("started_utc") or "")[:10] or "date ?"


def device(doc: dict[str, Any]) -> str:
    """Where the model stages ran, e.g. "ranking cuda, retrieval cuda (NVIDIA H100)" or "cpu"."""
    pipeline = doc.get("pipeline") or {}
    devices = {name: (pipeline.get(name) or {}).get("device") for name in ("retrieval", "ranking")}
    found = {d for d in devices.values() if d}
    if not found:
        found = {d for info in pipeline.values() if isinstance(info, dict) for d in [info.get("device")] if d}
    text = "/".join(sorted(found)) if found else "device ?"
    gpu = (doc.get("platform") or {}).get("gpu")
    if gpu and gpu != "none" and any("cuda" in d for d in found):
        text += f" ({gpu})"
    return text


def describe(doc: dict[str, Any]) -> str:
    """``"sequential, 300 queries, cpu, 2026-11-23"``: what the title of a chart says about a run."""
    mode = str(doc.get("mode", "?"))
    if doc.get("per_component"):
        mode += " per component"
    if doc.get("mode") == "open" and doc.get("target_rate"):
        mode += f" @ {doc['target_rate']:g} q/s"
    if doc.get("mode") == "closed" and doc.get("concurrency"):
        mode += f" x{doc['concurrency']}"
    return f"{mode}, {int(doc.get('queries') or 0):,} queries, {device(doc)}, {_date(doc)}"


def _title(fig: Any, what: str, runs: Labelled) -> None:
    if len(runs) == 1:
        fig.suptitle(f"{what}\n{describe(runs[0][1])}", fontsize=11)
    else:
        lines = "\n".join(f"{label}: {describe(doc)}" for label, doc in runs)
        fig.suptitle(f"{what}\n{lines}", fontsize=10)


def _count(doc: dict[str, Any]) -> int:
    return int(doc["end_to_end"].get("count", doc.get("ok", 0)) or 0)


def _split(doc: dict[str, Any], stage: str) -> bool:
    return bool(((doc["stages"][stage].get("batch_size") or {}).get("count") or 0) > 0)


def stage_bars_figure(runs: Labelled) -> Any:
    """Stacked per-stage latency bars at p50 and p99 for each run, stages bottom-up in chain order.

    Percentiles do not add up: the stack shows each stage's own p50 (p99), and "other" is what the end
    to end percentile has beyond their sum (network, gateway, client; 0 when the sum exceeds it). The
    black line is the end-to-end percentile itself, labelled beside it. Where a stage reports its
    queue/compute split, the queued part of its segment is hatched. A p99 the sample cannot support is
    drawn faded and marked.
    """
    fig = _figure(max(6.5, 2.3 * len(runs) + 3), 5.2)
    ax = fig.add_subplot(1, 1, 1)
    positions: list[float] = []
    labels: list[str] = []
    x = 0.0
    top = 0.0
    unsupported: list[str] = []
    seen: set[str] = set()
    hatched = False

    def once(name: str) -> str | None:
        if name in seen:
            return None
        seen.add(name)
        return name

    for label, doc in runs:
        n = _count(doc)
        for pct, key, p in (("p50", "p50_us", 50.0), ("p99", "p99_us", 99.0)):
            ok = supported(p, n)
            alpha = 1.0 if ok else 0.35
            bottom = 0.0
            for stage in STEPS:
                v = doc["stages"][stage][key] / 1000
                ax.bar(x, v, bottom=bottom, color=_COLORS[stage], width=0.8, alpha=alpha,
                       label=once(stage))
                if _split(doc, stage):
                    q = min(v, doc["stages"][stage]["queue"][key] / 1000)
                    ax.bar(x, q, bottom=bottom, color="none", edgecolor="white", hatch="///", width=0.8,
                           linewidth=0)
                    hatched = True
                bottom += v
            e2e = doc["end_to_end"][key] / 1000
            other = max(0.0, e2e - bottom)
            ax.bar(x, other, bottom=bottom, color=_COLORS["other"], width=0.8, alpha=alpha,
                   label=once("other (end to end - stages)"))
            # Tail percentiles of the stages can sum past the end-to-end one: mark where it really is,
            # and put its number at the line, beside the bar, not on top of the stack.
            ax.hlines(e2e, x - 0.45, x + 0.45, colors="black", linewidth=2, label=once("end to end"))
            ax.text(x + 0.47, e2e, f"{e2e:.2f}", ha="left", va="center", fontsize=8)
            top = max(top, e2e, bottom + other)
            positions.append(x)
            tick = f"{label}\n{pct}" if label else pct
            if not ok:
                tick += "*"
                unsupported.append(f"{label or 'run'} {pct} ({n:,} samples, needs {min_samples(p):,})")
            labels.append(tick)
            x += 1.25
        x += 0.5
    ax.set_xticks(positions, labels, fontsize=8)
    ax.set_xlim(-0.7, x - 0.6)
    ax.set_xlabel("run and percentile")
    ax.set_ylabel("latency (ms)")
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.grid(True, axis="y", alpha=0.3)
    _title(fig, "Per-stage latency, stacked in chain order; end to end (black line)", runs)
    handles, names = ax.get_legend_handles_labels()
    if hatched:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="#888888", edgecolor="white", hatch="///"))
        names.append("hatched: queued in the stage's batcher\n(rest of the segment: compute + transport)")
    legend = ax.legend(handles, names, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    # said on the chart, not only here: a p99 stack taller than its end-to-end line reads as a bug
    ax.annotate("each segment is its stage's own percentile:\nthey need not add up to end to end's\n"
                "(a query slow at one stage is rarely\nslow at all of them)", xy=(0, 0), xycoords=legend,
                xytext=(0, -8), textcoords="offset points", ha="left", va="top", fontsize=8, color="#444444")
    if unsupported:
        fig.text(0.01, -0.02, "* not supported by the sample, drawn faded: " + "; ".join(unsupported),
                 fontsize=7, ha="left", va="top")
    return fig


def supported_cdf(doc: dict[str, Any]) -> tuple[list[tuple[float, float]], float | None]:
    """The end-to-end CDF points the sample supports (percentile, ms), and the first percentile cut: of
    every query, the failed ones at their deadline or failure, whichever came later (``compare.block``),
    where the run says."""
    from recpipe.querygen.compare import block

    e2e = block(doc, "end_to_end")
    n = int(e2e.get("count", doc.get("ok", 0)) or 0)
    points: list[tuple[float, float]] = []
    cut: float | None = None
    for p, v in e2e.get("cdf") or []:
        if v <= 0:
            continue
        if p < 100 and not supported(p, n):
            cut = p if cut is None else min(cut, p)
            continue
        if p >= 100:
            continue  # the max is a single sample, not a percentile
        points.append((float(p), v / 1000))
    return points, cut


def latency_cdf_figure(runs: Labelled) -> Any:
    """End-to-end latency CDF (left) and the same data as a tail plot (right: x = percentile on a
    1/(1-p) log scale, so p99 and p99.9 get as much room as p50 and p90). Percentiles beyond what a
    run's sample supports are cut, and the cut is stated in the legend."""
    fig = _figure(12.0, 5.0)
    ax = fig.add_subplot(1, 2, 1)
    tail = fig.add_subplot(1, 2, 2)
    lo, hi = math.inf, 0.0
    max_tail = 50.0
    for label, doc in runs:
        points, cut = supported_cdf(doc)
        if not points:
            continue
        name = label or "end to end"
        failed = int((doc.get("failed") or {}).get("count") or 0)
        if failed:
            name += f" ({failed:,} failed, at their deadline or later)"
        if cut is not None:
            name += f" (no p{cut:g}: {_count(doc) + failed:,} queries, it needs {min_samples(cut):,})"
        ax.plot([v for _, v in points], [p for p, _ in points], marker=".", label=name)
        pts = [(1 / (1 - p / 100), v) for p, v in points if p > 0]
        tail.plot([x for x, _ in pts], [y for _, y in pts], marker=".", label=name)
        lo, hi = min(lo, *(v for _, v in points)), max(hi, *(v for _, v in points))
        max_tail = max([max_tail, *(p for p, _ in points)])
    if hi > 0:
        plain_log_axis(ax, "x", lo, hi)
        plain_log_axis(tail, "y", lo, hi)
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("share of queries at or below (percentile)")
    ax.set_ylim(0, 100.5)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title("Latency CDF", fontsize=10)
    ticks = [t for t in TAIL_TICKS if t <= max_tail + 1e-9]
    tail.set_xscale("log")
    tail.set_xticks([1 / (1 - t / 100) for t in ticks], [f"p{t:g}" for t in ticks])
    # to the last point plotted, not the last tick: a run that supports p99.5 drew past a p99 edge
    tail.set_xlim(0.9, 1 / (1 - min(max(max_tail, max(ticks)), 99.99) / 100) * 1.1)
    from matplotlib.ticker import NullLocator

    tail.xaxis.set_minor_locator(NullLocator())
    tail.set_xlabel("percentile (log of 1 / (1 - p))")
    tail.set_ylabel("end-to-end latency (ms)")
    tail.grid(True, which="major", alpha=0.3)
    tail.set_title("Tail (percentile spectrum)", fontsize=10)
    for a in (ax, tail):
        if a.get_lines():  # under the axes: a tail of failed queries can fill either corner
            a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    _title(fig, "End-to-end latency", runs)
    return fig


def slo_curve_figure(runs: Labelled) -> Any:
    """Rate-latency curve of an SLO search: p50 and p99 per step, the SLO line, the max rate."""
    fig = _figure(8.5, 5.0)
    ax = fig.add_subplot(1, 1, 1)
    values: list[float] = []
    slos: list[float] = []
    for label, doc in runs:
        slo = doc["slo"]
        curve = slo["curve"]
        rates = [c["target_rate"] for c in curve]
        prefix = f"{label} " if label else ""
        p99 = [c["p99_us"] / 1000 for c in curve]
        p50 = [c["p50_us"] / 1000 for c in curve]
        few = [c for c in curve if not supported(99.0, int(c.get("queries") or 0))]
        ax.plot(rates, p99, marker="o", label=f"{prefix}p99 per step")
        ax.plot(rates, p50, marker=".", linestyle="--", label=f"{prefix}p50 per step")
        if few:
            ax.plot([c["target_rate"] for c in few], [c["p99_us"] / 1000 for c in few], linestyle="none",
                    marker="o", markerfacecolor="none", markeredgecolor="black", markersize=11,
                    label=f"{prefix}p99 from < 100 queries (not supported)")
        if slo["max_rate"] is not None:
            ax.axvline(slo["max_rate"], color="green", alpha=0.6, linestyle=":",
                       label=f"{prefix}max rate meeting the SLO: {slo['max_rate']:.1f} q/s")
        ax.axhline(slo["slo_p99_ms"], color="red", alpha=0.6, label=f"SLO: p99 <= {slo['slo_p99_ms']:g} ms")
        values += [v for v in p99 + p50 if v > 0]
        slos.append(float(slo["slo_p99_ms"]))
    if values:
        plain_log_axis(ax, "y", min(values), max(values), extra=slos)
    ax.set_xlabel("offered rate (queries/s)")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    _title(fig, "Rate vs latency (open loop, SLO search)", runs)
    return fig


#: the charts of one run, by file name
RUN_CHARTS = ("stage_latency.png", "latency_cdf.png", "slo_curve.png")


def run_chart_names(doc: dict[str, Any] | None) -> tuple[str, ...]:
    """The file names ``run_plots`` draws for ``doc`` (None: a run not yet made, which may be an SLO search)."""
    return RUN_CHARTS if doc is None or doc.get("slo") else RUN_CHARTS[:2]


def run_plots(doc: dict[str, Any], out_dir: str | Path) -> dict[Path, bytes]:
    """The charts of one run, drawn: path in ``out_dir`` -> PNG."""
    d, runs = Path(out_dir), [("", doc)]
    figures = {"stage_latency.png": stage_bars_figure, "latency_cdf.png": latency_cdf_figure,
               "slo_curve.png": slo_curve_figure}
    return {d / name: png(figures[name](runs)) for name in run_chart_names(doc)}


def write_run_plots(doc: dict[str, Any], out_dir: str | Path, force: bool = False) -> list[Path]:
    """The charts of one run into ``out_dir`` (created if missing), all or none of them."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return write_files(run_plots(doc, out_dir), force)


def comparison_bars_figure(runs: Labelled, speedups: bool = True) -> Any:
    """Side by side per stage (chain order) and end to end, p50 (top) and p99 (bottom); speed-ups over
    the first run written above the other runs' bars (unless ``speedups`` is False)."""
    from recpipe.querygen.compare import ROWS, block, speedup

    fig = _figure(max(8.0, 1.6 * len(ROWS) * max(1, len(runs)) / 2 + 3), 8.5)
    width = 0.8 / len(runs)
    for i, (key, p) in enumerate((("p50_us", 50.0), ("p99_us", 99.0))):
        ax = fig.add_subplot(2, 1, i + 1)
        base = runs[0][1]
        for j, (label, doc) in enumerate(runs):
            xs = [k + (j - (len(runs) - 1) / 2) * width for k in range(len(ROWS))]
            values = [block(doc, row)[key] / 1000 for row in ROWS]
            ok = supported(p, _count(doc))
            ax.bar(xs, values, width=width, alpha=1.0 if ok else 0.35,
                   label=label if ok else f"{label} (p99 from {_count(doc):,} samples: not supported)")
            if j and speedups:
                for x, row, v in zip(xs, ROWS, values, strict=True):
                    b = block(base, row)[key] / 1000
                    r = speedup(b * 1000, v * 1000)
                    if r is not None:
                        ax.text(x, v, f"{r:.2f}x", ha="center", va="bottom", fontsize=9)
        ax.set_xticks(range(len(ROWS)), [r.replace("_", " ") for r in ROWS], fontsize=8)
        ax.set_xlabel("stage (chain order), then end to end")
        ax.set_ylabel(f"{key.removesuffix('_us')} latency (ms)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    what = "Per-stage latency side by side" + (" (speed-up vs the first run above the bars)" if speedups else "")
    _title(fig, what, runs)
    return fig

