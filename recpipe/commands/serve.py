"""Start the gRPC services (gateway, features, retrieval, ranking).

With --stage all (the default) every stage runs as its own process under a supervisor that waits until
all report SERVING, prints their addresses, restarts a stage that dies, and on SIGINT/SIGTERM drains
and stops them all. Ports: gateway --port (default 50051), then features, retrieval, ranking on the
next three (50052-50054); --port 0 picks free ports. Metrics: http://HOST:(gRPC port + 1000)/metrics
unless --metrics-port says otherwise (-1 turns them off).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_HOST, DEFAULT_MODELS_DIR, DEFAULT_PORTS
from recpipe.errors import UsageError

if TYPE_CHECKING:
    from recpipe.serving.config import StageConfig
    from recpipe.serving.supervisor import StageProcess, Supervisor

STAGES = ("all", "gateway", "features", "retrieval", "ranking")
#: --stage all: the order stage ports follow the gateway's.
PORT_ORDER = ("gateway", "features", "retrieval", "ranking")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR), help="model repository")
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR), help="dataset directory")
    parser.add_argument("--stage", choices=STAGES, default="all")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=None,
                        help="gRPC port (default: the stage's own, gateway 50051 ... ranking 50054; 0 = free)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="Prometheus port (default: gRPC port + 1000; 0 = free; -1 = off)")
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda[:N] for retrieval and ranking")
    parser.add_argument("--threads", type=int, default=0, help="compute threads per stage (0 = library default)")
    parser.add_argument("--workers", type=int, default=0,
                        help="run cores on N threads per stage instead of the event loop (0 = inline)")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds to drain in-flight requests on stop")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="--stage all: seconds to wait for SERVING")
    for stage in ("features", "retrieval", "ranking"):
        parser.add_argument(f"--{stage}", dest=f"target_{stage}", default=None, metavar="TARGET",
                            help=f"--stage gateway: {stage} target, host:port or dns:///host:port")


def _metrics_port(flag: int | None, grpc_port: int, offset: int) -> int | None:
    from recpipe.serving.config import METRICS_PORT_OFFSET

    if flag is None:
        return grpc_port + METRICS_PORT_OFFSET if grpc_port else 0
    if flag < 0:
        return None
    return flag + offset if flag else 0


def stage_config(args: argparse.Namespace, stage: str, port: int, metrics_port: int | None,
                 targets: dict[str, str] | None = None) -> StageConfig:
    from recpipe.serving.config import StageConfig

    return StageConfig(
        stage=stage, models_dir=args.models, data_dir=args.data, host=args.host, port=port,
        metrics_port=metrics_port, device=args.device, threads=args.threads, workers=args.workers,
        grace_s=args.grace, targets=targets or {},
    )


def run(args: argparse.Namespace) -> int:
    if args.port is not None and not 0 <= args.port <= 65535 - 3:
        raise UsageError(f"--port must be in 0..65532, got {args.port}")
    if args.stage != "all":
        return _run_one(args)
    return _run_all(args)


def _run_one(args: argparse.Namespace) -> int:
    import asyncio

    from recpipe.serving import runner
    from recpipe.serving.config import default_targets

    port = DEFAULT_PORTS[args.stage] if args.port is None else args.port
    targets = {}
    if args.stage == "gateway":
        targets = default_targets(_connect_host(args.host))
        for s in targets:
            targets[s] = getattr(args, f"target_{s}") or targets[s]
    cfg = stage_config(args, args.stage, port, _metrics_port(args.metrics_port, port, 0), targets)
    asyncio.run(runner.serve(cfg))
    return 0


def allocate_ports(host: str, base: int, metrics_flag: int | None) -> tuple[dict[str, int], dict[str, int | None]]:
    """gRPC and metrics ports per stage for --stage all: gateway ``base``, the others the next three;
    ``base`` 0 picks free ports. Metrics: gRPC port + 1000, or from ``metrics_flag`` (0 free, -1 off)."""
    from recpipe.serving.supervisor import free_port

    ports = {s: (base + i if base else free_port(host)) for i, s in enumerate(PORT_ORDER)}
    if metrics_flag == 0 or (metrics_flag is None and not base):
        return ports, {s: free_port(host) for s in PORT_ORDER}
    return ports, {s: _metrics_port(metrics_flag, ports[s], i) for i, s in enumerate(PORT_ORDER)}


def _run_all(args: argparse.Namespace) -> int:
    import signal
    import threading

    from recpipe.serving.supervisor import Supervisor

    for s in ("features", "retrieval", "ranking"):
        if getattr(args, f"target_{s}"):
            raise UsageError(f"--{s} only applies to --stage gateway")
    for path, what in ((args.models, "--models"), (args.data, "--data")):
        if not Path(path).is_dir():
            raise UsageError(f"{what} {path}: no such directory")
    base = DEFAULT_PORTS["gateway"] if args.port is None else args.port
    ports, metrics = allocate_ports(args.host, base, args.metrics_port)
    stages = supervised_stages(
        models=args.models, data=args.data, host=args.host, ports=ports, metrics=metrics, device=args.device,
        threads=args.threads, workers=args.workers, grace=args.grace, log_level=args.log_level,
    )
    supervisor = Supervisor(stages, startup_timeout_s=args.startup_timeout, grace_s=args.grace)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    supervisor.start(stop)
    print(f"recpipe serving ({len(stages)} stages; Ctrl-C stops):")
    print(summary(supervisor, stages, args.host))
    sys.stdout.flush()
    supervisor.run(stop)
    print("recpipe: all stages stopped", flush=True)
    return 0


def summary(supervisor: Supervisor, stages: list[StageProcess], host: str) -> str:
    """The machine line and one row per stage (address, pid, device and threads from its GetInfo)."""
    from recpipe.client import RecommendClient
    from recpipe.errors import RecpipeError
    from recpipe.querygen.platform_info import detect
    from recpipe.querygen.table import serve_table

    rows = []
    for spec in stages:
        row: dict[str, object] = {"name": spec.name, "address": spec.address, "pid": supervisor.pid(spec.name),
                                  "metrics": (f"http://{host}:{spec.metrics_port}/metrics"
                                              if spec.metrics_port is not None else None)}
        try:
            with RecommendClient(spec.address, timeout=5.0) as client:
                info = client.info()
            row.update(device=info.device, threads=info.threads)
        except RecpipeError:
            pass
        rows.append(row)
    return serve_table(rows, detect())


def _connect_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine (a wildcard is not a destination)."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


def supervised_stages(
    *, models: Path, data: Path, host: str, ports: dict[str, int], metrics: dict[str, int | None],
    device: str = "auto", threads: int = 0, workers: int = 0, grace: float = 5.0, log_level: str = "WARNING",
) -> list[StageProcess]:
    """One ``StageProcess`` per stage: ``python -m recpipe serve --stage NAME`` with explicit ports, so
    a restarted stage comes back where the gateway expects it."""
    from recpipe.serving.supervisor import StageProcess

    connect = _connect_host(host)
    specs = []
    for name in ("features", "retrieval", "ranking", "gateway"):
        argv = [
            sys.executable, "-m", "recpipe", "--log-level", log_level, "serve", "--stage", name,
            "--models", str(models), "--data", str(data), "--host", host, "--port", str(ports[name]),
            "--metrics-port", str(-1 if metrics[name] is None else metrics[name]),
            "--device", device, "--threads", str(threads), "--workers", str(workers), "--grace", str(grace),
        ]
        if name == "gateway":
            for s in ("features", "retrieval", "ranking"):
                argv += [f"--{s}", f"{connect}:{ports[s]}"]
        specs.append(StageProcess(name, f"{connect}:{ports[name]}", tuple(argv), metrics[name]))
    return specs
