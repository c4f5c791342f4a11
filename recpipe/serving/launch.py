"""Launching a registry's stages as processes: ports, and the command line of each supervised stage.

``recpipe serve --stage all``, ``recpipe demo`` and the benches that start a chain do it this way: one
``python -m recpipe serve --stage NAME`` process per stage, each with explicit ports, so a restarted
stage comes back where the stages calling it expect it. The ports follow each spec's ``port_offset``
from the entry stage's base port; a stage's upstream targets are the ports of the stages it calls.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from recpipe.serving.config import METRICS_PORT_OFFSET
from recpipe.serving.spec import Registry
from recpipe.serving.supervisor import StageProcess, free_port


def metrics_port(flag: int | None, grpc_port: int, offset: int) -> int | None:
    """A stage's metrics port: gRPC port + 1000 by default (0 when the gRPC port is free-picked), the
    flag's value + the stage's port offset, 0 for a free port, None (off) for a negative flag."""
    if flag is None:
        return grpc_port + METRICS_PORT_OFFSET if grpc_port else 0
    if flag < 0:
        return None
    return flag + offset if flag else 0


def allocate_ports(registry: Registry, host: str, base: int,
                   metrics_flag: int | None) -> tuple[dict[str, int], dict[str, int | None]]:
    """gRPC and metrics ports per stage: ``base`` + each stage's offset; ``base`` 0 picks free ports.
    Metrics: gRPC port + 1000, or from ``metrics_flag`` (0 free, -1 off)."""
    ports = {s.name: (base + s.port_offset if base else free_port(host)) for s in registry}
    if metrics_flag == 0 or (metrics_flag is None and not base):
        return ports, {s.name: free_port(host) for s in registry}
    return ports, {s.name: metrics_port(metrics_flag, ports[s.name], s.port_offset) for s in registry}


#: ``--threads`` help, shared by every command that starts the chain.
THREADS_HELP = ("compute threads per stage: auto (default) shares this machine's cores among the stages in "
                "proportion to their cost; N for every stage; 0 = the libraries' defaults")


def threads_arg(text: str) -> int | None:
    """``--threads``: "auto" (None) or a count >= 0."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be auto or a number >= 0, got {text!r}")
    return value


def resolve_threads(registry: Registry, flag: int | None) -> tuple[int | dict[str, int], str]:
    """The ``threads`` for ``supervised_stages`` and a line saying what was chosen: ``flag`` for every
    stage, or with ``auto`` (None) each stage's share of the cores this process may use."""
    if flag is not None:
        return flag, f"threads: {flag or 'library default'} per stage"
    cores = len(os.sched_getaffinity(0))
    shares = registry.auto_threads(cores)
    chosen = ", ".join(f"{name} {n}" for name, n in shares.items() if n)
    return shares, f"threads: auto on {cores} core{'s' * (cores != 1)}: {chosen} (by each stage's cost; --threads N to set)"


def connect_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine (a wildcard is not a destination)."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


def supervised_stages(
    registry: Registry, *, models: Path, data: Path, host: str, ports: dict[str, int],
    metrics: dict[str, int | None], device: str = "auto", threads: int | dict[str, int] = 0, workers: int = 0,
    grace: float = 5.0,
    log_level: str = "WARNING", extra: Sequence[str] = (),
) -> list[StageProcess]:
    """One ``StageProcess`` per stage, in the registry's order: ``python -m recpipe serve --stage NAME``
    with explicit ports and its upstream targets. ``threads``: for every stage, or per stage (``--threads
    auto``: ``Registry.auto_threads``). ``extra`` is appended to every stage's arguments (the batching
    flags and the stages' own options)."""
    connect = connect_host(host)
    processes = []
    for spec in registry:
        name = spec.name
        argv = [
            sys.executable, "-m", "recpipe", "--log-level", log_level, "serve", "--stage", name,
            "--models", str(models), "--data", str(data), "--host", host, "--port", str(ports[name]),
            "--metrics-port", str(-1 if metrics[name] is None else metrics[name]),
            "--device", device, "--threads", str(threads if isinstance(threads, int) else threads[name]),
            "--workers", str(workers), "--grace", str(grace),
            *extra,
        ]
        for upstream in spec.upstream:
            argv += [f"--{upstream}", f"{connect}:{ports[upstream]}"]
        processes.append(StageProcess(name, f"{connect}:{ports[name]}", tuple(argv), metrics[name]))
    return processes
