"""Generate data, train, serve and measure: the whole pipeline in one command.

synth-data -> train -> serve (every stage its own process, on free ports) -> a few hundred sequential
Recommend queries measured by the query generator -> the per-stage latency table (the same table
``recpipe querygen`` prints), a run document WORKDIR/run-UTC.json and its charts in WORKDIR/charts-UTC/,
and the commands to try next. A workdir that already holds data and models is reused; --force
regenerates both. Progress goes to stderr, the table and the next steps to stdout.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from recpipe.config import DEFAULT_NUM_RESULTS
from recpipe.errors import UsageError
from recpipe.serving.affinity import AFFINITY_HELP, affinity_arg
from recpipe.serving.launch import REPLICAS_HELP, THREADS_HELP, replicas_arg, threads_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", type=float, default=0.02, help="dataset scale (1 = full size; default 0.02)")
    parser.add_argument("--queries", type=int, default=300, help="sequential queries to time (default 300)")
    parser.add_argument("--workdir", type=Path, default=Path("demo"), help="where data/ and models/ go (default: demo)")
    parser.add_argument("--force", action="store_true", help="regenerate data and models in --workdir")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default: train's own)")
    parser.add_argument("--num-candidates", type=int, default=0, help="candidates per query (0 = 500)")
    parser.add_argument("--num-results", type=int, default=0, help="results per query (0 = 10)")
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda for retrieval and ranking")
    parser.add_argument("--threads", type=threads_arg, default=None, help=THREADS_HELP)
    parser.add_argument("--replicas", type=replicas_arg, default=None, metavar="STAGE=N[,...]|N|auto",
                        help=REPLICAS_HELP + ". Default 1 each")
    parser.add_argument("--affinity", type=affinity_arg, default="auto", metavar="auto|off", help=AFFINITY_HELP)
    parser.add_argument("--seed", type=int, default=0, help="seed of the query user ids")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.scale <= 1:
        raise UsageError(f"--scale must be in (0, 1], got {args.scale}")
    if args.queries < 1:
        raise UsageError(f"--queries must be >= 1, got {args.queries}")
    if args.epochs is not None and args.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {args.epochs}")
    from recpipe.cli import main

    data, models = args.workdir / "data", args.workdir / "models"
    try:
        args.workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--workdir {args.workdir}: cannot create it ({e})") from None
    force = ["--force"] if args.force else []
    if args.force or not (data / "manifest.json").exists():
        _step(f"synth-data: scale {args.scale} -> {data}")
        rc = main(["--log-level", args.log_level, "synth-data", "--out", str(data), "--scale", str(args.scale),
                   "--quiet", *force])
        if rc:
            return rc
        force = ["--force"]  # new data: the old models no longer belong to it
    else:
        _step(f"synth-data: reusing {data}{_other_scale(data, args.scale)} (--force regenerates)")
    if force or not (models / "manifest.json").exists():
        _step(f"train -> {models}")
        epochs = ["--epochs", str(args.epochs)] if args.epochs else []
        rc = main(["--log-level", args.log_level, "train", "--data", str(data), "--out", str(models), *epochs, *force])
        if rc:
            return rc
    else:
        _step(f"train: reusing {models} (--force retrains)")
    return _serve_and_measure(args, data, models)


def _other_scale(data: Path, scale: float) -> str:
    """", made at scale X, not the Y asked for" where the reused dataset's scale differs from --scale."""
    from recpipe.datagen.manifest import load_manifest
    from recpipe.errors import ArtifactMismatch

    try:
        made = float(load_manifest(data)["scale"])
    except (ArtifactMismatch, TypeError, ValueError):  # scale is a required key
        return ""  # training says what is wrong with it
    return f", made at scale {made:g}, not the {scale:g} asked for" if made != scale else ""


def _step(message: str) -> None:
    print(f"== {message}", file=sys.stderr, flush=True)


def _serve_and_measure(args: argparse.Namespace, data: Path, models: Path) -> int:
    import datetime as dt

    from recpipe.config import DEFAULT_HOST, DEFAULT_NUM_CANDIDATES
    from recpipe.querygen import loops, output, plots, session
    from recpipe.querygen.config import QuerygenConfig
    from recpipe.querygen.workload import fixed_candidates
    from recpipe.repository import check_serving
    from recpipe.serving.launch import direct_target, plan_chain
    from recpipe.serving.supervisor import Supervisor
    from recpipe.stages import REGISTRY

    host = DEFAULT_HOST
    chain = plan_chain(REGISTRY, models=models, data=data, host=host, replicas=args.replicas, threads=args.threads,
                       affinity=args.affinity, device=args.device, log_level=args.log_level)
    check_serving(models, data)
    stages = chain.processes
    _step(f"serve: starting {', '.join(REGISTRY.names)}; {'; '.join(chain.said)}")
    supervisor = Supervisor(stages)
    supervisor.start()
    try:
        for spec in stages:
            print(f"   {spec.name:<10} {spec.address}  pid {supervisor.pid(spec.name)}", file=sys.stderr)
        gateway = direct_target(stages, REGISTRY.entry.name)  # every gateway replica, per call
        k = args.num_candidates or DEFAULT_NUM_CANDIDATES
        config = QuerygenConfig(target=gateway, mode="sequential", candidates=fixed_candidates(k),
                                queries=args.queries, warmup=WARMUP_S,
                                num_results=args.num_results or DEFAULT_NUM_RESULTS, seed=args.seed)
        _step(f"querygen: {args.queries} sequential queries after {WARMUP_S:g} s of warm-up")
        doc = loops.run(session.execute(config))
    finally:
        supervisor.stop()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    run_json = args.workdir / f"run-{stamp}.json"
    charts = args.workdir / f"charts-{stamp}"
    output.write_json(run_json, doc, force=False)
    drawn = plots.write_run_plots(doc, charts, force=False)
    for w in doc["warnings"]:
        print(f"recpipe demo: warning: {w}", file=sys.stderr)
    print(output.summary_text(doc))
    print(f"\nwrote {run_json} and {len(drawn)} charts in {charts}/ ({', '.join(p.name for p in drawn)})")
    same = "".join(f" --{flag} {value}" for flag, value in (("num-candidates", args.num_candidates),
                                                             ("num-results", args.num_results)) if value)
    print(next_steps(args.workdir, run_json, same, serving_flags(args)))
    sys.stdout.flush()
    return 0 if doc["ok"] else 1


#: seconds of queries before the measured ones (connections, caches and the first torch calls)
WARMUP_S = 1.0


def serving_flags(args: argparse.Namespace) -> str:
    """The demo's serving flags the user set, as ``recpipe serve`` takes them (each the same flag there):
    the suggested serve runs the chain the demo measured."""
    given = (("--device", args.device if args.device != "auto" else None),
             ("--threads", args.threads), ("--replicas", args.replicas),
             ("--affinity", args.affinity if args.affinity != "auto" else None))
    return "".join(f" {flag} {shlex.quote(str(value))}" for flag, value in given if value is not None)


def next_steps(workdir: Path, run_json: Path, same: str = "", serving: str = "") -> str:
    """The commands to try after the demo, with this demo's paths filled in; ``same`` holds the demo's
    query-mix flags and ``serving`` its serving flags (``serving_flags``), so the suggested run is of the
    same chain and comparable with it in ``recpipe report``."""
    from recpipe.querygen.slo import SloSearch  # its steps: the suggested search runs up to that many

    # the load test lives beside the package in a checkout; elsewhere, name it as the README does
    loadtest = Path(__file__).resolve().parents[2] / "loadtest"
    locust = loadtest if loadtest.is_dir() else Path("loadtest/")

    def q(path: Path) -> str:  # pasted into a shell: a path with a space or a quote stays one word
        return shlex.quote(str(path))

    return "\n".join([
        "next, try:",
        f"  recpipe serve --models {q(workdir / 'models')} --data {q(workdir / 'data')}{serving} &       # the same stages, "
        "kept running: wait for its table (~30 s) before the next commands",
        f"  recpipe querygen --target 127.0.0.1:50051 --queries 2000 --warmup 5{same} --out seq.json --plot seq/",
        f"  recpipe report {q(run_json)} seq.json --labels demo,seq --out report/   # side by side",
        "  recpipe querygen --target 127.0.0.1:50051 --mode open --rate 10 --slo-p99-ms 50 --duration 20 "
        f"--out slo.json --plot slo/   # up to {SloSearch.max_steps} steps of 20 s each: a few minutes",
        f"  locust -f {q(locust)} --headless -u 8 -r 8 -t 30s --host 127.0.0.1:50051",
    ])
