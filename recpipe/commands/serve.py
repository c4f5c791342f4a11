"""Start the gRPC services (gateway, features, retrieval, ranking).

With --stage all (the default) every stage runs as its own process under a supervisor that waits until
all report SERVING, prints their addresses, restarts a stage that dies or stops answering its health
checks (--unresponsive-timeout), and on SIGINT/SIGTERM drains and stops them all. Ports: gateway --port
(default 50051), then features, retrieval, ranking on the next three (50052-50054); --port 0 picks free
ports. Metrics: http://HOST:(gRPC port + 1000)/metrics unless --metrics-port says otherwise (-1 turns
them off).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from recpipe.config import (
    DEFAULT_DATA_DIR,
    DEFAULT_HOST,
    DEFAULT_MODELS_DIR,
    DEFAULT_PORTS,
    DEFAULT_RESCORE,
    EMBEDDING_PLACEMENTS,
    MAX_RESCORE,
    RETRIEVAL_PRECISIONS,
)
from recpipe.errors import UsageError
from recpipe.ranking.precision import PRECISIONS as RANKING_PRECISIONS
from recpipe.ranking.precision import SERVE_DEFAULT as RANKING_PRECISION_DEFAULT
from recpipe.serving.config import DEFAULT_MAX_IN_FLIGHT

if TYPE_CHECKING:
    from recpipe.serving.batcher import BatchConfig
    from recpipe.serving.config import GpuConfig, StageConfig
    from recpipe.serving.supervisor import StageProcess, Supervisor

STAGES = ("all", "gateway", "features", "retrieval", "ranking")
#: Defaults of --host and of the gateway's stage targets, for containers (docker-compose.yml sets them,
#: an override such as docker-compose.hostnet.yml changes them). Flags win over the environment.
BIND_HOST_ENV = "RECPIPE_BIND_HOST"


def target_env(stage: str) -> str:
    """The environment variable holding the gateway's default target for ``stage``."""
    return f"RECPIPE_{stage.upper()}_TARGET"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR), help="model repository")
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR), help="dataset directory")
    parser.add_argument("--stage", choices=STAGES, default="all")
    parser.add_argument("--host", default=os.environ.get(BIND_HOST_ENV) or DEFAULT_HOST,
                        help=f"address to bind (default ${BIND_HOST_ENV}, else {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=None,
                        help="gRPC port (default: the stage's own, gateway 50051 ... ranking 50054; 0 = free)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="Prometheus port (default: gRPC port + 1000; 0 = free; -1 = off)")
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda[:N] for retrieval and ranking")
    parser.add_argument("--threads", type=int, default=0, help="compute threads per stage (0 = library default)")
    parser.add_argument("--workers", type=int, default=0,
                        help="run unbatched core calls on N threads per stage instead of the event loop (0 = inline)")
    batching = parser.add_argument_group("dynamic batching and admission (retrieval, ranking, AugmentItems)")
    batching.add_argument("--max-batch", type=int, default=0,
                          help="requests per core call at most (1 = batching off; default 0 = auto: 32 where "
                               "the stage computes on a GPU, 1 on a CPU, where a batch only adds waiting)")
    batching.add_argument("--max-queue-delay-us", type=int, default=0,
                          help="how long the first queued request may wait for others, in µs "
                               "(0 = take what is queued; default %(default)s)")
    batching.add_argument("--max-queue", type=int, default=256,
                          help="requests waiting per stage method at most; more are refused with "
                               "RESOURCE_EXHAUSTED (default %(default)s)")
    batching.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT,
                          help="gateway: Recommend calls in progress at most; more are refused with "
                               "RESOURCE_EXHAUSTED (default %(default)s)")
    gpu = parser.add_argument_group("GPU fast path (retrieval, ranking on a CUDA device)")
    gpu.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                     help="replay a CUDA graph per bucketed batch shape (ranking forward, user tower; "
                          "default on; no effect on the CPU)")
    gpu.add_argument("--retrieval-precision", choices=RETRIEVAL_PRECISIONS, default="auto",
                     help="exact retrieval scan in fp16/bf16 on the device (auto: fp16 on CUDA, the FAISS index "
                          "on the CPU; fp32: FAISS / fp32 exact)")
    gpu.add_argument("--rescore", type=int, default=DEFAULT_RESCORE,
                     help=f"half-precision retrieval keeps N x k candidates and re-scores them in fp32 "
                          f"(0 = off, max {MAX_RESCORE}; default %(default)s)")
    gpu.add_argument("--embeddings", choices=EMBEDDING_PLACEMENTS, default="device",
                     help="DLRM tables in device memory, or in pinned host memory read by the GPU in place "
                          "(host: CUDA only)")
    gpu.add_argument("--nvtx", action="store_true",
                     help="NVTX ranges per stage step (decode, queue, compute, encode) for nsys (CUDA only)")
    parser.add_argument("--ranking-precision", choices=RANKING_PRECISIONS, default=RANKING_PRECISION_DEFAULT,
                        help="ranking forward on the CPU in fp32, bf16 (CPUs with native bf16) or int8 (dynamic "
                             "quantization); auto (default): the fastest here within 0.002 held-out AUC of fp32, "
                             "as measured by recpipe train; a CUDA device runs fp32")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds to drain in-flight requests on stop")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="--stage all: seconds to wait for SERVING")
    parser.add_argument("--unresponsive-timeout", type=_seconds, default=None, metavar="SECONDS",
                        help="--stage all: restart a stage whose health has not answered for this long "
                             "(default 5; 0 = never)")
    for stage in ("features", "retrieval", "ranking"):
        env = target_env(stage)
        parser.add_argument(f"--{stage}", dest=f"target_{stage}", default=None,
                            metavar="TARGET", help=f"--stage gateway: {stage} target, host:port, dns:///host:port "
                            f"or ipv4:host:port,host:port (default ${env}, else HOST:its default port)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def stage_config(args: argparse.Namespace, stage: str, port: int, metrics_port: int | None,
                 targets: dict[str, str] | None = None) -> StageConfig:
    from recpipe.serving.config import StageConfig

    return StageConfig(
        stage=stage, models_dir=args.models, data_dir=args.data, host=args.host, port=port,
        metrics_port=metrics_port, device=args.device, threads=args.threads, workers=args.workers,
        grace_s=args.grace, targets=targets or {}, batch=batch_config(args), max_in_flight=args.max_in_flight,
        gpu=gpu_config(args), ranking_precision=args.ranking_precision,
    )


def gpu_config(args: argparse.Namespace) -> GpuConfig:
    """The GPU fast-path settings from the flags (validated: a clear error and exit code 2 when off)."""
    from recpipe.serving.config import GpuConfig

    return GpuConfig(args.cuda_graphs, args.retrieval_precision, args.rescore, args.embeddings, args.nvtx)


def batch_config(args: argparse.Namespace) -> BatchConfig:
    """The batcher knobs from the flags (validated: a clear error and exit code 2 when off)."""
    from recpipe.serving.batcher import BatchConfig

    return BatchConfig(args.max_batch, args.max_queue_delay_us, args.max_queue)


def batch_flags(args: argparse.Namespace) -> list[str]:
    """The same knobs as flags, for the stage processes ``--stage all`` starts."""
    return ["--max-batch", str(args.max_batch), "--max-queue-delay-us", str(args.max_queue_delay_us),
            "--max-queue", str(args.max_queue), "--max-in-flight", str(args.max_in_flight)]


def run(args: argparse.Namespace) -> int:
    batch_config(args)  # bad knobs fail here, before any process starts
    gpu_config(args).check_machine(args.device)
    from recpipe.serving.config import check_max_in_flight

    check_max_in_flight(args.max_in_flight)
    if args.port is not None and not 0 <= args.port <= 65535 - 3:
        raise UsageError(f"--port must be in 0..65532, got {args.port}")
    if args.stage != "all":
        return _run_one(args)
    return _run_all(args)


def gateway_targets(args: argparse.Namespace) -> dict[str, str]:
    """The gateway's stage targets: --features/--retrieval/--ranking, else $RECPIPE_<STAGE>_TARGET, else
    the stage's default port on the bind host (a wildcard bind reaches them on 127.0.0.1)."""
    from recpipe.serving import launch
    from recpipe.serving.config import default_targets

    targets = default_targets(launch.connect_host(args.host))
    return {s: getattr(args, f"target_{s}") or os.environ.get(target_env(s)) or t for s, t in targets.items()}


def _run_one(args: argparse.Namespace) -> int:
    import asyncio

    if args.unresponsive_timeout is not None:
        raise UsageError("--unresponsive-timeout only applies to --stage all (the supervisor)")

    from recpipe import stages
    from recpipe.serving import launch, runner

    port = DEFAULT_PORTS[args.stage] if args.port is None else args.port
    targets = gateway_targets(args) if args.stage == "gateway" else {}
    cfg = stage_config(args, args.stage, port, launch.metrics_port(args.metrics_port, port, 0), targets)
    asyncio.run(runner.serve(cfg, stages.build_stage(cfg)))
    return 0


def _run_all(args: argparse.Namespace) -> int:
    import signal
    import threading

    from recpipe.serving import launch
    from recpipe.serving.supervisor import DEFAULT_UNRESPONSIVE_S, Supervisor

    for s in ("features", "retrieval", "ranking"):
        if getattr(args, f"target_{s}"):
            raise UsageError(f"--{s} only applies to --stage gateway")
    for path, what in ((args.models, "--models"), (args.data, "--data")):
        if not Path(path).is_dir():
            raise UsageError(f"{what} {path}: no such directory")
    base = DEFAULT_PORTS["gateway"] if args.port is None else args.port
    ports, metrics = launch.allocate_ports(args.host, base, args.metrics_port)
    stages = launch.supervised_stages(
        models=args.models, data=args.data, host=args.host, ports=ports, metrics=metrics, device=args.device,
        threads=args.threads, workers=args.workers, grace=args.grace, log_level=args.log_level,
        extra=batch_flags(args) + gpu_config(args).flags() + ["--ranking-precision", args.ranking_precision],
    )
    unresponsive = DEFAULT_UNRESPONSIVE_S if args.unresponsive_timeout is None else args.unresponsive_timeout
    supervisor = Supervisor(stages, startup_timeout_s=args.startup_timeout, grace_s=args.grace,
                            unresponsive_s=unresponsive)

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


