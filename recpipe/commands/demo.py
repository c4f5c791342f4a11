"""Generate data, train, serve and measure: the whole pipeline in one command.

synth-data -> train -> serve (every stage its own process, on free ports) -> a few hundred sequential
Recommend queries -> the per-stage latency table (p50/p90/p99 of server and gateway-observed time).
A workdir that already holds data and models is reused; --force regenerates both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recpipe.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", type=float, default=0.02, help="dataset scale (1 = full size)")
    parser.add_argument("--queries", type=int, default=300, help="sequential queries to time")
    parser.add_argument("--workdir", type=Path, default=Path("demo"), help="where data/ and models/ go")
    parser.add_argument("--force", action="store_true", help="regenerate data and models in --workdir")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default: train's own)")
    parser.add_argument("--num-candidates", type=int, default=0, help="candidates per query (0 = 500)")
    parser.add_argument("--num-results", type=int, default=0, help="results per query (0 = 10)")
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda for retrieval and ranking")
    parser.add_argument("--threads", type=int, default=0, help="compute threads per stage (0 = library default)")
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
        _step(f"synth-data: reusing {data} (--force regenerates)")
    if force or not (models / "manifest.json").exists():
        _step(f"train -> {models}")
        epochs = ["--epochs", str(args.epochs)] if args.epochs else []
        rc = main(["--log-level", args.log_level, "train", "--data", str(data), "--out", str(models), *epochs, *force])
        if rc:
            return rc
    else:
        _step(f"train: reusing {models} (--force retrains)")
    return _serve_and_measure(args, data, models)


def _step(message: str) -> None:
    print(f"== {message}", flush=True)


def _serve_and_measure(args: argparse.Namespace, data: Path, models: Path) -> int:
    import numpy as np

    from recpipe.client import RecommendClient, run_sequential
    from recpipe.config import DEFAULT_HOST
    from recpipe.gateway.latency import format_table
    from recpipe.serving.launch import allocate_ports, supervised_stages
    from recpipe.serving.supervisor import Supervisor

    host = DEFAULT_HOST
    ports, metrics = allocate_ports(host, 0, -1)
    stages = supervised_stages(models=models, data=data, host=host, ports=ports, metrics=metrics,
                               device=args.device, threads=args.threads, log_level=args.log_level)
    _step("serve: starting features, retrieval, ranking, gateway (one process each)")
    supervisor = Supervisor(stages)
    supervisor.start()
    try:
        for spec in stages:
            print(f"   {spec.name:<10} {spec.address}  pid {supervisor.pid(spec.name)}")
        addresses = supervisor.addresses()
        with RecommendClient(addresses["features"]) as probe:
            num_users = int(probe.info().details["num_users"])
        with RecommendClient(addresses["gateway"]) as client:
            rng = np.random.default_rng(args.seed)
            warm = rng.integers(0, num_users, size=min(20, args.queries))
            run_sequential(client, warm.tolist(), args.num_candidates, args.num_results)
            users = rng.integers(0, num_users, size=args.queries)
            _step(f"{args.queries} sequential queries (warm-up {len(warm)} not counted)")
            recs, client_us = run_sequential(client, users.tolist(), args.num_candidates, args.num_results)
            info = client.info()
        with RecommendClient(addresses["ranking"]) as probe:
            device = probe.info().device
    finally:
        supervisor.stop()
    k = args.num_candidates or 500
    print(f"\nper-stage latency, {len(recs)} queries, num_candidates {k}, model {info.model_version or '?'}, "
          f"retrieval/ranking on {device}")
    print(format_table(recs, client_us))
    sys.stdout.flush()
    return 0
