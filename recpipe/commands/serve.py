"""Start the gRPC services (gateway, features, retrieval, ranking).

With --stage all (the default) every stage runs as its own process under a supervisor that waits until
all report SERVING, prints their addresses, restarts a stage that dies or stops answering its health
checks (--unresponsive-timeout), and on SIGINT/SIGTERM drains and stops them all. Ports: gateway --port
(default 50051), then features, retrieval, ranking on the next three (50052-50054); --port 0 picks free
ports. Metrics: http://HOST:(gRPC port + 1000)/metrics unless --metrics-port says otherwise (-1 turns
them off). --replicas runs a stage as several processes: a called stage's replicas on their own ports
(+100 each), balanced per call by its callers; the gateway's behind its one port (SO_REUSEPORT).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_HOST, DEFAULT_MODELS_DIR, DEFAULT_PORT
from recpipe.errors import UsageError
from recpipe.serving.affinity import AFFINITY_HELP, affinity_arg, parse_cpus
from recpipe.serving.batcher import BatchConfig
from recpipe.serving.config import DEFAULT_UNRESPONSIVE_S
from recpipe.serving.launch import REPLICAS_HELP, THREADS_HELP, replicas_arg, threads_arg
from recpipe.stages import registry

if TYPE_CHECKING:
    from recpipe.serving.config import StageConfig
    from recpipe.serving.spec import Registry
    from recpipe.serving.supervisor import StageProcess, Supervisor

#: Defaults of --host and of the stages' upstream targets, for containers (docker-compose.yml sets them,
#: an override such as docker-compose.hostnet.yml changes them). Flags win over the environment.
BIND_HOST_ENV = "RECPIPE_BIND_HOST"


def target_env(stage: str) -> str:
    """The environment variable holding the default target through which other stages reach ``stage``."""
    return f"RECPIPE_{stage.upper()}_TARGET"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    stages = registry()
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR),
                        help=f"model repository (default: {DEFAULT_MODELS_DIR})")
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR), help=f"dataset directory (default: {DEFAULT_DATA_DIR})")
    parser.add_argument("--stage", choices=("all", *stages.names), default="all")
    parser.add_argument("--host", default=os.environ.get(BIND_HOST_ENV) or DEFAULT_HOST,
                        help=f"address to bind (default ${BIND_HOST_ENV}, else {DEFAULT_HOST})")
    ports = ", ".join(f"{s.name} {DEFAULT_PORT + s.port_offset}" for s in sorted(stages, key=lambda s: s.port_offset))
    parser.add_argument("--port", type=int, default=None,
                        help=f"gRPC port (default: the stage's own: {ports}; with --stage all the {stages.entry.name}'s, "
                             f"the others follow; 0 = free)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="Prometheus port (default: gRPC port + 1000; 0 = free; -1 = off)")
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda[:N] for the stages that run a model")
    parser.add_argument("--threads", type=threads_arg, default=None, help=THREADS_HELP)
    parser.add_argument("--workers", type=int, default=0,
                        help="run core calls on N threads per stage instead of the event loop (0 = inline when "
                             "predicted short, else on a thread)")
    parser.add_argument("--nvtx", action="store_true",
                        help="NVTX ranges per stage step (decode, queue, compute, encode) for nsys (CUDA only)")
    seen: dict[str, object] = {}
    BatchConfig.add_arguments(parser, seen)  # type: ignore[arg-type]
    stages.add_option_arguments(parser)
    parser.add_argument("--grace", type=float, default=5.0, help="seconds to drain in-flight requests on stop")
    _add_connection_age_arguments(parser)
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="--stage all: seconds to wait for SERVING")
    parser.add_argument("--warm-standby", action=argparse.BooleanOptionalAction, default=True,
                        help="--stage all: keep a loaded standby process per stage, so a stage that dies or "
                             "freezes is replaced in milliseconds instead of seconds (default on; costs each "
                             "stage's memory twice)")
    parser.add_argument("--standby", action="store_true", help=argparse.SUPPRESS)  # what the supervisor passes
    parser.add_argument("--replicas", type=replicas_arg, default=None, metavar="STAGE=N[,...]|N|auto",
                        help=f"--stage all: {REPLICAS_HELP}. Default 1 each")
    parser.add_argument("--affinity", type=affinity_arg, default=None, metavar="auto|off",
                        help=f"--stage all: {AFFINITY_HELP}")
    parser.add_argument("--cpus", type=parse_cpus, default=None, metavar="LIST",
                        help="--stage NAME: run this process on these CPUs, e.g. 1 or 0-3 (what --affinity passes)")
    parser.add_argument("--bind-after-load", action="store_true",
                        help="--stage NAME: take the port only once loaded (a replica: callers balancing over "
                             "several never pick one still loading)")
    parser.add_argument("--reuse-port", action="store_true",
                        help="--stage NAME: share --port with this stage's other processes (SO_REUSEPORT; the "
                             "kernel spreads connections): replicas behind one address")
    parser.add_argument("--own-port", type=int, default=None, metavar="PORT",
                        help="--stage NAME: also listen on PORT, this process alone (a replica's health "
                             "checks and GetInfo; 0 = free)")
    parser.add_argument("--unresponsive-timeout", type=_seconds, default=None, metavar="SECONDS",
                        help="--stage all: restart a stage whose health has not answered for this long "
                             f"(default {DEFAULT_UNRESPONSIVE_S:g}; 0 = never)")
    for spec in stages:
        for upstream in spec.upstream:
            parser.add_argument(f"--{upstream}", dest=_target_dest(upstream), default=None, metavar="TARGET",
                                help=f"--stage {spec.name}: {upstream} target, host:port, dns:///host:port or "
                                     f"ipv4:host:port,host:port (default ${target_env(upstream)}, else HOST:its "
                                     f"default port)")


def _target_dest(stage: str) -> str:
    return f"target_{stage}"


def _add_connection_age_arguments(parser: argparse.ArgumentParser) -> None:
    from recpipe.serving.connection_age import (
        DEFAULT_MAX_CONNECTION_AGE_GRACE_S,
        DEFAULT_MAX_CONNECTION_AGE_S,
        MAX_CONNECTION_AGE_ENV,
        MAX_CONNECTION_AGE_GRACE_ENV,
    )

    age = parser.add_argument_group("connection age (clients re-resolve and find new replicas)")
    age.add_argument("--max-connection-age", type=_seconds, default=None, metavar="SECONDS",
                     help=f"close each client connection after this long, so clients re-resolve dns:/// names "
                          f"(0 = never; default ${MAX_CONNECTION_AGE_ENV}, else {DEFAULT_MAX_CONNECTION_AGE_S:g})")
    age.add_argument("--max-connection-age-grace", type=_seconds, default=None, metavar="SECONDS",
                     help=f"RPCs in flight on such a connection get this long to finish (default "
                          f"${MAX_CONNECTION_AGE_GRACE_ENV}, else {DEFAULT_MAX_CONNECTION_AGE_GRACE_S:g})")


def _export_connection_age(args: argparse.Namespace) -> None:
    """The flags win over the environment; they reach this process's server and every stage process
    ``--stage all`` starts through the environment (``ConnectionAge.from_env``), checked here first."""
    from recpipe.serving.connection_age import (
        MAX_CONNECTION_AGE_ENV,
        MAX_CONNECTION_AGE_GRACE_ENV,
        ConnectionAge,
    )

    for env, value in ((MAX_CONNECTION_AGE_ENV, args.max_connection_age),
                       (MAX_CONNECTION_AGE_GRACE_ENV, args.max_connection_age_grace)):
        if value is not None:
            os.environ[env] = repr(value)
    ConnectionAge.from_env()


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    stages = registry()
    _check_flags(args)
    batch = BatchConfig.from_namespace(args)  # bad values fail here, before any process starts
    options = stages.options(args)
    for opts in options.values():
        opts.check_machine(args.device)
    if args.nvtx:
        from recpipe.serving import nvtx

        nvtx.check_available()
    _export_connection_age(args)
    top = 65535 - max(s.port_offset for s in stages)
    if args.port is not None and not 0 <= args.port <= top:
        raise UsageError(f"--port must be in 0..{top}, got {args.port}")
    if args.stage != "all":
        return _run_one(args, stages, batch, options)
    return _run_all(args, stages, batch, options)


def _check_flags(args: argparse.Namespace) -> None:
    """The shared flags' values, in this process, before any stage process starts (each would refuse
    them, one error per process, after the others had loaded)."""
    from recpipe.accel import device

    for flag, value in (("--grace", args.grace), ("--startup-timeout", args.startup_timeout)):
        if not 0 <= value < math.inf or (flag == "--startup-timeout" and value == 0):
            raise UsageError(f"{flag} must be a finite number of seconds {'> 0' if flag == '--startup-timeout' else '>= 0'}, "
                             f"got {value}")
    if args.workers < 0:
        raise UsageError(f"--workers must be >= 0, got {args.workers}")
    if args.metrics_port is not None and not -1 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be in 0..65535, or -1 (off), got {args.metrics_port}")
    name = args.device.strip().lower()
    if name not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", name):
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    if name.startswith("cuda") and args.stage == "all":
        # CUDA asked for by name: present, and that device (torch loads for it), once for the whole chain
        device.resolve(name)
    try:
        socket.getaddrinfo(args.host, None)
    except (socket.gaierror, UnicodeError):
        raise UsageError(f"--host {args.host!r} is not an address or name this machine can bind") from None


def upstream_targets(args: argparse.Namespace, stages: Registry, stage: str) -> dict[str, str]:
    """The targets of the stages ``stage`` calls: --NAME, else $RECPIPE_<NAME>_TARGET, else the stage's
    default port on the bind host (a wildcard bind reaches them on 127.0.0.1)."""
    from recpipe.serving import launch

    host = launch.connect_host(args.host)
    return {u: getattr(args, _target_dest(u)) or os.environ.get(target_env(u))
            or f"{host}:{DEFAULT_PORT + stages.get(u).port_offset}" for u in stages.get(stage).upstream}


def _run_one(args: argparse.Namespace, stages: Registry, batch: BatchConfig, options: dict) -> int:
    import asyncio

    for flag, value in (("--unresponsive-timeout", args.unresponsive_timeout), ("--replicas", args.replicas),
                        ("--affinity", args.affinity)):
        if value is not None:
            raise UsageError(f"{flag} only applies to --stage all (the supervisor)")
    _refuse_foreign_targets(args, stages, args.stage)
    if args.cpus is not None:
        from recpipe.serving.affinity import pin

        pin(args.cpus)  # before the stage loads a library that starts threads: they inherit it

    from recpipe.serving import launch, runner

    spec = stages.get(args.stage)
    if spec.nice:
        os.nice(spec.nice)  # this process is the stage's own
    port = DEFAULT_PORT + spec.port_offset if args.port is None else args.port
    cfg = stage_config(args, spec.name, port, launch.metrics_port(args.metrics_port, port, 0),
                       upstream_targets(args, stages, spec.name), batch, options[spec.name])
    asyncio.run(runner.serve(cfg, stages.build(cfg)))
    return 0


def stage_config(args: argparse.Namespace, stage: str, port: int, metrics_port: int | None, targets: dict[str, str],
                 batch: BatchConfig, options: object) -> StageConfig:
    from recpipe.serving.config import StageConfig
    from recpipe.serving.options import StageOptions

    assert isinstance(options, StageOptions)
    return StageConfig(stage=stage, models_dir=args.models, data_dir=args.data, host=args.host, port=port,
                       metrics_port=metrics_port, device=args.device, threads=args.threads or 0, workers=args.workers,
                       grace_s=args.grace, targets=targets, batch=batch, nvtx=args.nvtx, options=options,
                       standby=args.standby, bind_after_load=args.bind_after_load, reuse_port=args.reuse_port,
                       own_port=args.own_port)


def _refuse_foreign_targets(args: argparse.Namespace, stages: Registry, stage: str | None) -> None:
    """A target flag given to a stage that calls no such stage is a mistake, not something to ignore."""
    own = set(stages.get(stage).upstream) if stage else set()
    for spec in stages:
        for upstream in spec.upstream:
            if upstream not in own and getattr(args, _target_dest(upstream)):
                raise UsageError(f"--{upstream} only applies to --stage {spec.name}")


def _run_all(args: argparse.Namespace, stages: Registry, batch: BatchConfig, options: dict) -> int:
    import signal
    import threading

    from recpipe.repository import check_serving
    from recpipe.serving import launch
    from recpipe.serving.options import merged_argv
    from recpipe.serving.supervisor import Supervisor

    _refuse_foreign_targets(args, stages, None)
    for flag, used in (("--bind-after-load", args.bind_after_load), ("--reuse-port", args.reuse_port),
                       ("--own-port", args.own_port is not None), ("--cpus", args.cpus is not None)):
        if used:
            raise UsageError(f"{flag} only applies to --stage NAME (--stage all sets it for replicas)")
    chain = launch.plan_chain(
        stages, models=args.models, data=args.data, host=args.host, replicas=args.replicas, threads=args.threads,
        affinity=args.affinity or "auto", device=args.device, base=DEFAULT_PORT if args.port is None else args.port,
        metrics=args.metrics_port, workers=args.workers, grace=args.grace, log_level=args.log_level,
        extra=[*batch.to_argv(), *(["--nvtx"] if args.nvtx else []), *merged_argv(options.values())],
    )
    processes = chain.processes
    busy = launch.busy_port(processes, args.host)
    if busy is not None:
        name, port = busy
        raise UsageError(f"{args.host}:{port} ({name}) is in use: another recpipe serve? Stop it, or choose another "
                         "--port (or --metrics-port)")
    if stages.reads_models:  # recpipe's own stages do; a test's toy stages read none
        check_serving(args.models, args.data)
    unresponsive = DEFAULT_UNRESPONSIVE_S if args.unresponsive_timeout is None else args.unresponsive_timeout
    supervisor = Supervisor(processes, startup_timeout_s=args.startup_timeout, grace_s=args.grace,
                            unresponsive_s=unresponsive, standby=args.warm_standby)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    supervisor.start(stop)
    many = f", {len(processes)} processes" if len(processes) > len(stages) else ""
    print(f"recpipe serving ({len(stages)} stages{many}; Ctrl-C stops):")
    print(summary(supervisor, processes, args.host))
    replicas_line, threads_line, placed = chain.said
    print(threads_line)
    print(replicas_line)
    print(placed)
    sys.stdout.flush()
    supervisor.run(stop)
    print("recpipe: all stages stopped", flush=True)
    return 0


def summary(supervisor: Supervisor, stages: list[StageProcess], host: str) -> str:
    """The machine line, one row per stage process (address, pid, device and threads from its GetInfo;
    a replica's own address), then how each stage run as replicas is reached."""
    from recpipe.client import RecommendClient
    from recpipe.errors import RecpipeError
    from recpipe.querygen.platform_info import detect
    from recpipe.querygen.table import serve_table
    from recpipe.serving.launch import direct_target

    rows = []
    wait = ""  # the gateway's upstream wait as it resolved it (GetInfo), said once
    for spec in stages:
        row: dict[str, object] = {"name": spec.name, "stage": spec.stage, "address": spec.address,
                                  "pid": supervisor.pid(spec.name),
                                  "metrics": (f"http://{host}:{spec.metrics_port}/metrics"
                                              if spec.metrics_port is not None else None)}
        try:
            with RecommendClient(spec.address, timeout=5.0) as client:
                info = client.info()
            row.update(device=info.device, threads=info.threads)
            wait = wait or info.details.get("upstream_wait_us", "")
        except RecpipeError:
            pass
        rows.append(row)
    lines = [serve_table(rows, detect())]
    for stage, names in supervisor.replicas().items():
        if len(names) > 1:
            target = supervisor.addresses()[stage]
            how = ("every address in its callers' target; each batch call to the first free replica"
                   if target.startswith(("ipv4:", "ipv6:")) else
                   "sharing one port (SO_REUSEPORT: the kernel spreads client connections; one client "
                   f"process reaches them all, per call, at {direct_target(stages, stage)})")
            lines.append(f"{stage}: {len(names)} replicas at {target}: {how}")
    if wait:
        lines.append(upstream_wait_line(wait))
    return "\n".join(lines)


def upstream_wait_line(detail: str) -> str:
    """What the gateway's ``upstream_wait_us`` detail ("2000 (auto: 4 processes, 2 cores)") means."""
    value, _, why = detail.partition(" ")
    why = f" (--hop-upstream-wait-us {why.strip('()')})" if why else ""
    if value == "0":
        return f"gateway: a batched hop sends what it has at once{why}"
    return f"gateway: an idle batched hop waits up to {value} µs for the queries on their way to it{why}"


