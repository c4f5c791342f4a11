"""PNG charts of run documents (headless: matplotlib's Agg canvas, never pyplot or a display).

Each function takes one or more ``(label, run_doc)`` pairs, so ``recpipe report`` draws the same charts
for several runs side by side.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recpipe.config import STAGES
from recpipe.querygen.output import write_atomic

Labelled = Sequence[tuple[str, dict[str, Any]]]

_COLORS = {"augment_user": "#4C72B0", "retrieve": "#DD8452", "augment_items": "#55A868", "rank": "#C44E52",
           "other": "#BBBBBB"}


def _figure(width: float = 8.0, height: float = 4.5) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path, force: bool) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return write_atomic(path, buf.getvalue(), force)


def stage_bars(runs: Labelled, path: Path, force: bool = False) -> Path:
    """Stacked per-stage latency bars at p50 and p99 for each run.

    Percentiles do not add up: the stack shows each stage's own p50 (p99), and "other" is what the end
    to end percentile has beyond their sum (network, gateway, client; 0 when the sum exceeds it).
    """
    fig = _figure(max(6.0, 2.2 * len(runs) + 2), 4.8)
    ax = fig.add_subplot(1, 1, 1)
    positions: list[float] = []
    labels: list[str] = []
    x = 0.0
    top = 0.0
    for label, doc in runs:
        for pct, key in (("p50", "p50_us"), ("p99", "p99_us")):
            bottom = 0.0
            for stage in STAGES:
                v = doc["stages"][stage][key] / 1000
                ax.bar(x, v, bottom=bottom, color=_COLORS[stage], width=0.8,
                       label=stage if not positions else None)
                bottom += v
            e2e = doc["end_to_end"][key] / 1000
            other = max(0.0, e2e - bottom)
            ax.bar(x, other, bottom=bottom, color=_COLORS["other"], width=0.8,
                   label="other (end to end - stages)" if not positions else None)
            # Tail percentiles of the stages can sum past the end-to-end one: mark where it really is.
            ax.hlines(e2e, x - 0.4, x + 0.4, colors="black", linewidth=2,
                      label="end to end" if not positions else None)
            ax.text(x, max(e2e, bottom + other), f"{e2e:.1f}", ha="center", va="bottom", fontsize=8)
            top = max(top, e2e, bottom + other)
            positions.append(x)
            labels.append(f"{label}\n{pct}" if label else pct)
            x += 1.0
        x += 0.5
    ax.set_xticks(positions, labels, fontsize=8)
    ax.set_ylabel("latency (ms)")
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.set_title("Per-stage latency (stacked) and end to end (black)")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path, force)


def latency_cdf(runs: Labelled, path: Path, force: bool = False) -> Path:
    """End-to-end latency CDF (left) and the same data as a tail plot (right: x = percentile on a
    1/(1-p) log scale, so p99 and p99.9 get as much room as p50 and p90)."""
    fig = _figure(11.0, 4.5)
    ax = fig.add_subplot(1, 2, 1)
    tail = fig.add_subplot(1, 2, 2)
    ticks = [50.0, 90.0, 99.0, 99.9, 99.99]
    for label, doc in runs:
        cdf = [(p, v) for p, v in doc["end_to_end"].get("cdf") or [] if v > 0]
        if not cdf:
            continue
        ax.plot([v / 1000 for _, v in cdf], [p for p, _ in cdf], marker=".", label=label or None)
        pts = [(1 / (1 - p / 100), v / 1000) for p, v in cdf if 0 < p < 100]
        tail.plot([x for x, _ in pts], [y for _, y in pts], marker=".", label=label or None)
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("percentile")
    ax.set_ylim(0, 100.5)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("End-to-end latency CDF")
    tail.set_xscale("log")
    tail.set_xticks([1 / (1 - t / 100) for t in ticks], [f"p{t:g}" for t in ticks])
    tail.set_ylabel("end-to-end latency (ms)")
    tail.grid(True, which="both", alpha=0.3)
    tail.set_title("Tail (percentile spectrum)")
    if any(label for label, _ in runs):
        ax.legend(fontsize=8)
    return _save(fig, path, force)


def slo_curve(runs: Labelled, path: Path, force: bool = False) -> Path:
    """Rate-latency curve of an SLO search: p50 and p99 per step, the SLO line, the max rate."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for label, doc in runs:
        slo = doc["slo"]
        curve = slo["curve"]
        rates = [c["target_rate"] for c in curve]
        prefix = f"{label} " if label else ""
        ax.plot(rates, [c["p99_us"] / 1000 for c in curve], marker="o", label=f"{prefix}p99")
        ax.plot(rates, [c["p50_us"] / 1000 for c in curve], marker=".", linestyle="--", label=f"{prefix}p50")
        if slo["max_rate"] is not None:
            ax.axvline(slo["max_rate"], color="green", alpha=0.5, linestyle=":")
        ax.axhline(slo["slo_p99_ms"], color="red", alpha=0.6, label=f"SLO p99 {slo['slo_p99_ms']:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (queries/s)")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.set_title("Rate vs latency (open loop)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, force)


def write_run_plots(doc: dict[str, Any], out_dir: str | Path, force: bool = False) -> list[Path]:
    """The charts of one run into ``out_dir`` (created if missing)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    runs = [("", doc)]
    paths = [stage_bars(runs, d / "stage_latency.png", force), latency_cdf(runs, d / "latency_cdf.png", force)]
    if doc.get("slo"):
        paths.append(slo_curve(runs, d / "slo_curve.png", force))
    return paths


def comparison_bars(runs: Labelled, path: Path, force: bool = False) -> Path:
    """Side by side per stage and end to end, p50 (top) and p99 (bottom); speed-ups over the first run
    written above the other runs' bars."""
    from recpipe.querygen.compare import ROWS, speedup

    fig = _figure(max(8.0, 1.6 * len(ROWS) * max(1, len(runs)) / 2 + 3), 8.0)
    width = 0.8 / len(runs)
    for i, key in enumerate(("p50_us", "p99_us")):
        ax = fig.add_subplot(2, 1, i + 1)
        base = runs[0][1]
        for j, (label, doc) in enumerate(runs):
            xs = [k + (j - (len(runs) - 1) / 2) * width for k in range(len(ROWS))]
            values = [(doc["end_to_end"] if row == "end_to_end" else doc["stages"][row])[key] / 1000
                      for row in ROWS]
            ax.bar(xs, values, width=width, label=label)
            if j:
                for x, row, v in zip(xs, ROWS, values, strict=True):
                    b = (base["end_to_end"] if row == "end_to_end" else base["stages"][row])[key] / 1000
                    r = speedup(b * 1000, v * 1000)
                    if r is not None:
                        ax.text(x, v, f"{r:.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(ROWS)), [r.replace("_", " ") for r in ROWS], fontsize=8)
        ax.set_ylabel(f"{key.removesuffix('_us')} latency (ms)")
        ax.grid(True, axis="y", alpha=0.3)
        if i == 0:
            ax.set_title("Per-stage latency side by side (speed-up vs the first run)")
            ax.legend(fontsize=8)
    return _save(fig, path, force)
