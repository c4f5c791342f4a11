"""Compare querygen runs side by side, per stage.

``recpipe report A.json B.json --out DIR`` writes DIR/report.md (platforms, a per-stage p50/p99 table
with speed-ups over the first run, one verdict line per run such as "B is 1.23x faster end to end (p50);
... augment_items 1.60x; rank 1.00x") and beside it comparison.png (per-stage bars), stages.png
(stacked per-stage p50/p99) and latency_cdf.png; the Markdown is also printed. Runs of different
modes or workloads (mode, clients, offered rate, user and candidate mix) are refused unless --force:
a closed-loop run is not "faster" than a sequential one. Stages are listed in chain order everywhere.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN.json", help="run documents from querygen --out; "
                        "the first is the baseline")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for report.md and the PNGs")
    parser.add_argument("--labels", help="comma-separated names for the runs (default: file names)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing report in DIR, and compare "
                        "runs of different modes or workloads (refused otherwise: their speed-ups mislead)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from recpipe.errors import UsageError
    from recpipe.files import write_atomic
    from recpipe.querygen import compare, output, plots

    docs = [output.load_run(p) for p in args.runs]
    if args.labels:
        labels = [x.strip() for x in args.labels.split(",")]
        if len(labels) != len(docs):
            raise UsageError(f"--labels names {len(labels)} runs, but {len(docs)} were given")
    else:
        labels = [Path(p).stem for p in args.runs]
        if len(set(labels)) != len(labels):
            labels = [f"{i + 1}:{label}" for i, label in enumerate(labels)]
    unlike = []
    for label, doc in zip(labels[1:], docs[1:], strict=True):
        diff = compare.differences(docs[0], doc)
        if diff:
            unlike.append(f"{label} vs {labels[0]}: {', '.join(diff)}")
    if unlike and not args.force:
        raise UsageError(f"will not compute speed-ups between unlike runs ({'; '.join(unlike)}); measure them "
                         "the same way, or pass --force to compare anyway")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is not a directory")
    names = ("report.md", "comparison.png", "stages.png", "latency_cdf.png")
    if not args.force:
        clash = [n for n in names if (out / n).exists()]
        if clash:
            raise UsageError(f"{out / clash[0]} exists; pass --force to overwrite the report")
    out.mkdir(parents=True, exist_ok=True)
    runs = list(zip(labels, docs, strict=True))
    plots.comparison_bars(runs, out / "comparison.png", force=True)
    plots.stage_bars(runs, out / "stages.png", force=True)
    plots.latency_cdf(runs, out / "latency_cdf.png", force=True)
    text = compare.markdown(runs, charts=names[1:], unlike=unlike)
    write_atomic(out / "report.md", text, force=True)
    print(text, end="")
    return 0
