"""Measure this platform in one run: latency per stage, a concurrency sweep, SLO searches, micro-benchmarks.

``recpipe characterize --out DIR`` writes DIR/characterization.json (versioned; the platform and every
setting, then one block per section: platform, sequential per-stage latency, the closed-loop
concurrency sweep 1, 2, 4, ... with CPU seconds per query per stage process, the SLO search for a few
p99 bounds, the ranking/retrieval/features/hop micro-benchmarks, the data paths between CPU and GPU:
copy bandwidth, small-copy latency, gathers from host and GPU memory, docs/characterize-data-paths.md;
GPU busy fraction on CUDA) and
DIR/report/ (report.md and its PNGs). Without --data/--models it generates them in DIR (synth-data at
--scale, train). Each section is saved as it finishes: a rerun with the same --out skips finished
sections, so an interrupted or budget-limited run resumes. ``recpipe report A B`` compares two.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from recpipe.bench._args import above, at_least, require_dirs
from recpipe.config import DEFAULT_NUM_CANDIDATES, DEFAULT_NUM_RESULTS
from recpipe.errors import ArtifactMismatch, UsageError
from recpipe.serving.affinity import AFFINITY_HELP, affinity_arg
from recpipe.serving.launch import REPLICAS_HELP, THREADS_HELP, replicas_arg, resolve_replicas, threads_arg
from recpipe.stages import REGISTRY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the document and report go")
    parser.add_argument("--scale", type=float, default=1.0, help="dataset scale when generating data (default 1)")
    parser.add_argument("--data", type=Path, help="reuse this dataset (default: generate DIR/data)")
    parser.add_argument("--models", type=Path, help="reuse this model repository (default: train DIR/models)")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs when training (default: train's)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="retrieval and ranking device (and the benches')")
    parser.add_argument("--threads", type=threads_arg, default=None, help=THREADS_HELP)
    parser.add_argument("--replicas", type=replicas_arg, default="auto", metavar="STAGE=N[,...]|N|auto",
                        help=REPLICAS_HELP + ". Default auto: the chain as this machine can run it")
    parser.add_argument("--affinity", type=affinity_arg, default="auto", metavar="auto|off", help=AFFINITY_HELP)
    parser.add_argument("--workers", type=int, default=0, help="serve --workers for every stage")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for every stage's serve command, e.g. --serve-arg=--max-batch=8 "
                             "(repeatable)")
    parser.add_argument("--quick", action="store_true", help="a small run of every section (seconds each)")
    parser.add_argument("--sweep-p99-ms", type=float, default=None, metavar="MS",
                        help="the sweep stops once end-to-end p99 passes this (default 200; 500 with --quick)")
    parser.add_argument("--slo-p99-ms", default=None, metavar="MS[,MS...]",
                        help="p99 bounds of the SLO searches (default 10,20,50; 200 with --quick)")
    parser.add_argument("--budget-s", type=float, default=1800.0,
                        help="no section starts after this many seconds (default %(default)s); rerun to resume")
    parser.add_argument("--num-candidates", type=int, default=DEFAULT_NUM_CANDIDATES, help="candidates per query")
    parser.add_argument("--num-results", type=int, default=DEFAULT_NUM_RESULTS, help="results per query")
    parser.add_argument("--seed", type=int, default=0, help="seed of the query mix")
    parser.add_argument("--generator-processes", default="auto", metavar="N|auto",
                        help="querygen --processes for the sweep and the SLO searches (default auto: as many "
                             "senders as the load needs, within the cores)")
    parser.add_argument("--force", action="store_true",
                        help="start over in a DIR that holds a characterization (by other settings, or finished)")


def run(args: argparse.Namespace) -> int:
    from recpipe.characterize import document, report, runner
    from recpipe.characterize.sections import say
    from recpipe.characterize.settings import FULL, QUICK, RESUMABLE, Settings, differences
    from recpipe.querygen.config import parse_processes

    if not 0 < args.scale <= 1:
        raise UsageError(f"--scale must be in (0, 1], got {args.scale}")
    if args.epochs is not None and args.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {args.epochs}")
    above(0, ("--budget-s", args.budget_s))  # finite: inf would be written as Infinity, which is not JSON
    at_least(1, ("--num-candidates", args.num_candidates), ("--num-results", args.num_results))
    at_least(0, ("--workers", args.workers), ("--seed", args.seed))
    processes = parse_processes(args.generator_processes, "--generator-processes")
    sizes = _sizes(QUICK if args.quick else FULL, args)  # its checks before anything is written
    resolve_replicas(REGISTRY, args.replicas, args.device)  # the stage names too, as `recpipe serve` checks them
    _check_serve_args(args.serve_arg, args.device)
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is not a directory")
    _check_data_and_models(args.data, args.models)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot create it ({e})") from None
    path = out / document.FILENAME
    previous = document.load(path) if path.exists() and not args.force else None

    data, models = _data_and_models(args, out)
    manifest = _manifest(data)
    threads = "auto" if args.threads is None else str(args.threads)
    settings = Settings(quick=args.quick, sizes=sizes, data=str(data), models=str(models),
                        data_scale=manifest.get("scale"), data_seed=manifest.get("seed"),
                        dataset_sha256=manifest.get("dataset_sha256"), device=args.device, threads=threads,
                        replicas=args.replicas, affinity=args.affinity, workers=args.workers, serve_args=tuple(args.serve_arg),
                        num_candidates=args.num_candidates, num_results=args.num_results, seed=args.seed,
                        budget_s=args.budget_s, generator_processes=processes)
    current = settings.to_json()
    if previous is not None:
        diff = differences(previous["settings"], current, RESUMABLE)
        if diff:
            raise UsageError(f"{path} was measured with other settings ({'; '.join(diff)}): use another --out, "
                             "or --force to start over")
        doc = previous
        doc["settings"]["budget_s"] = settings.budget_s
        say(f"resuming {path}: finished {', '.join(doc['sections']) or 'nothing yet'}")
    else:
        doc = document.new(current)
    doc = runner.run(settings, out, doc, args.log_level)
    drawn = report.write(doc, out / "report")
    say(f"report: {out / 'report' / report.MARKDOWN} and {len(drawn)} charts")
    print(report.summary(doc))
    return 0


def _check_serve_args(serve_args: list[str], device: str) -> None:
    """What a stage's ``recpipe serve`` would refuse of ``--serve-arg``, refused now: its own parser and checks."""
    from recpipe.cli import build_parser
    from recpipe.serving.batcher import BatchConfig

    if not serve_args:
        return
    if {"-h", "--help"} & set(serve_args):  # the parser would print serve's help and exit
        raise UsageError("--serve-arg --help: a stage cannot run with it (see `recpipe serve --help`)")
    try:
        ns = build_parser().parse_args(["serve", "--stage", REGISTRY.entry.name, "--device", device, *serve_args])
        BatchConfig.from_namespace(ns)
        for options in REGISTRY.options(ns).values():
            options.check_machine(device)
    except UsageError as e:
        raise UsageError(f"--serve-arg {' '.join(serve_args)}: {e}") from None


def _check_data_and_models(data: Path | None, models: Path | None) -> None:
    """--data must be a dataset, --models a model repository trained on it (``UsageError`` naming the flag)."""
    from recpipe.datagen import load_manifest
    from recpipe.repository import Repository

    try:
        for flag, path, check in (("--data", data, load_manifest), ("--models", models, Repository.open)):
            if path is not None:
                require_dirs((flag, path))  # as serve says it: no such directory, not a directory
                if not (path / "manifest.json").is_file():
                    raise UsageError(f"{flag} {path}: no manifest.json there")
                check(path)
        if data is not None and models is not None:
            flag = "--data and --models"
            Repository.open(models).check_dataset(data)
    except ArtifactMismatch as e:
        raise UsageError(f"{flag}: {e}") from None


def _sizes(base: Any, args: argparse.Namespace) -> Any:
    """The run's sizes, with --sweep-p99-ms and --slo-p99-ms in place of the defaults."""
    import dataclasses

    changes: dict[str, Any] = {}
    if args.sweep_p99_ms is not None:
        above(0, ("--sweep-p99-ms", args.sweep_p99_ms))
        changes["sweep_p99_ms"] = args.sweep_p99_ms
    if args.slo_p99_ms is not None:
        try:
            bounds = tuple(float(x) for x in args.slo_p99_ms.split(","))
        except ValueError:
            raise UsageError(f"--slo-p99-ms takes numbers separated by commas, got {args.slo_p99_ms!r}") from None
        if not bounds or not all(0 < b < math.inf for b in bounds):
            raise UsageError(f"--slo-p99-ms bounds must be numbers of ms > 0, got {args.slo_p99_ms!r}")
        changes["slo_bounds_ms"] = bounds
    return dataclasses.replace(base, **changes)


def _step(message: str) -> None:
    print(f"== {message}", file=sys.stderr, flush=True)


def _data_and_models(args: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    """--data/--models as given, else generated in DIR (as ``recpipe demo`` does; reused when there)."""
    from recpipe.cli import main

    data = args.data or out / "data"
    models = args.models or out / "models"
    if args.data is None and not (data / "manifest.json").exists():
        _step(f"synth-data: scale {args.scale} -> {data}")
        rc = main(["--log-level", args.log_level, "synth-data", "--out", str(data), "--scale", str(args.scale),
                   "--quiet"])
        if rc:
            raise UsageError(f"synth-data failed (exit code {rc})")
    if args.models is None and not (models / "manifest.json").exists():
        _step(f"train -> {models}")
        epochs = ["--epochs", str(args.epochs)] if args.epochs else []
        rc = main(["--log-level", args.log_level, "train", "--data", str(data), "--out", str(models), *epochs])
        if rc:
            raise UsageError(f"train failed (exit code {rc})")
    return data.resolve(), models.resolve()


def _manifest(data: Path) -> dict[str, Any]:
    try:
        doc = json.loads((data / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"--data {data}: cannot read manifest.json ({e})") from None
    return doc if isinstance(doc, dict) else {}
