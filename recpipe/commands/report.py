"""Compare querygen runs side by side, per stage.

``recpipe report A.json B.json --out DIR`` writes DIR/report.md (platforms, a per-stage p50/p99 table
with speed-ups over the first run, one verdict line per run such as "B is 1.23x faster end to end (p50);
... augment_items 1.60x; rank 1.00x") and beside it comparison.png (per-stage bars), stages.png
(stacked per-stage p50/p99) and latency_cdf.png; the Markdown is also printed. Runs of different
modes or workloads (mode, clients, offered rate, user and candidate mix) are refused unless --force:
a closed-loop run is not "faster" than a sequential one. Stages are listed in chain order everywhere.

Given characterizations (``recpipe characterize --out DIR``: DIR or DIR/characterization.json), it
compares them section by section instead (sequential per stage, CPU per query, the sweep, the SLO
searches, the micro-benchmarks) into DIR/report.md, curves.png and stages.png, and refuses (warns
under --force) where their settings differ, naming each.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN.json", help="run documents from querygen --out, or "
                        "characterizations (DIR of characterize --out); the first is the baseline")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for report.md and the PNGs")
    parser.add_argument("--labels", help="comma-separated names for the runs (default: file names)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing report in DIR, and compare "
                        "runs of different modes or workloads (refused otherwise: their speed-ups mislead)")


def run(args: argparse.Namespace) -> int:
    from recpipe.characterize import document
    from recpipe.errors import UsageError
    from recpipe.files import check_writable, output_dir, write_files
    from recpipe.querygen import compare, output, plots

    kinds = {document.peek_format(p) == document.FORMAT for p in args.runs}
    if kinds == {True}:
        return _characterizations(args)
    if len(kinds) > 1:
        raise UsageError("give querygen runs or characterizations, not a mix of both")
    docs = [output.load_run(p) for p in args.runs]
    labels = _labels(args)
    unlike = _unlike(labels, docs, compare.differences)
    if unlike and not args.force:
        raise UsageError(f"will not compute speed-ups between unlike runs ({'; '.join(unlike)}); measure them "
                         "the same way, or pass --force to compare anyway")
    names = ("report.md", "comparison.png", "stages.png", "latency_cdf.png")
    with output_dir(args.out, "--out") as out:
        for name in names:
            check_writable(out / name, args.force)
        runs = list(zip(labels, docs, strict=True))
        text = compare.markdown(runs, charts=names[1:], unlike=unlike)
        # drawn in memory, then written as one set: Ctrl-C while drawing leaves no charts without report.md
        write_files({out / "comparison.png": plots.png(plots.comparison_bars_figure(runs)),
                     out / "stages.png": plots.png(plots.stage_bars_figure(runs)),
                     out / "latency_cdf.png": plots.png(plots.latency_cdf_figure(runs)),
                     out / "report.md": text}, args.force)
    print(text, end="")
    return 0


def _labels(args: argparse.Namespace) -> list[str]:
    from pathlib import Path

    from recpipe.errors import UsageError

    if args.labels is not None:
        labels = [x.strip() for x in args.labels.split(",")]
        if len(labels) != len(args.runs):
            raise UsageError(f"--labels names {len(labels)} runs, but {len(args.runs)} were given")
        if not all(labels):
            raise UsageError(f"--labels {args.labels!r} leaves a run without a name")
        if len(set(labels)) != len(labels):
            raise UsageError(f"--labels {args.labels!r} names two runs the same")
    else:
        # a characterization is named by its directory (DIR/characterization.json -> DIR)
        labels = [Path(p).name if Path(p).is_dir() else Path(p).parent.name if Path(p).name == "characterization.json"
                  else Path(p).stem for p in args.runs]
        if len(set(labels)) != len(labels):
            labels = [f"{i + 1}:{label}" for i, label in enumerate(labels)]
    # A label heads Markdown table columns, where '|' ends a cell and a line break ends the row. Refused,
    # not escaped: the same label names the charts' legends, where an escaping backslash would show.
    bad = next((label for label in labels if "|" in label or not label.isprintable()), None)
    if bad is not None:
        raise UsageError(f"run name {bad!r} holds '|' or a control character, which would break the report's "
                         "tables; name the runs with --labels")
    return labels


def _characterizations(args: argparse.Namespace) -> int:
    """``recpipe report A B`` on characterizations (``recpipe characterize --out``): section by section."""

    from recpipe.characterize import compare, document
    from recpipe.errors import UsageError
    from recpipe.files import check_writable, output_dir, write_files

    docs = [document.load(p) for p in args.runs]
    labels = _labels(args)
    unlike = _unlike(labels, docs, compare.differences)
    if unlike and not args.force:
        raise UsageError(f"will not compute speed-ups between characterizations measured differently "
                         f"({'; '.join(unlike)}); pass --force to compare anyway")
    for line in unlike:
        print(f"recpipe report: warning: settings differ: {line}", file=sys.stderr)
    with output_dir(args.out, "--out") as out:
        for name in ("report.md", *compare.CHARTS):
            check_writable(out / name, args.force)
        # drawn in memory, then written as one set (see ``run``)
        drawn = compare.files(list(zip(labels, docs, strict=True)), unlike)
        write_files({out / name: content for name, content in drawn.items()}, args.force)
        text = str(drawn["report.md"])
    print(text, end="")
    return 0


def _unlike(labels: list[str], docs: list[dict[str, Any]],
            differences: Callable[[dict[str, Any], dict[str, Any]], list[str]]) -> list[str]:
    """"A vs B: what differs" (A's value first, as ``differences`` gives them) for every document
    measured differently from the first, A."""
    unlike = []
    for label, doc in zip(labels[1:], docs[1:], strict=True):
        diff = differences(docs[0], doc)
        if diff:
            unlike.append(f"{labels[0]} vs {label}: {', '.join(diff)}")
    return unlike
