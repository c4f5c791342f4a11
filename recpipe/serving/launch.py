"""Launching the stages as processes: ports, and the command line of each supervised stage.

``recpipe serve --stage all``, ``recpipe demo`` and ``recpipe bench chain`` start the chain this way:
one ``python -m recpipe serve --stage NAME`` process per stage, each with explicit ports, so a
restarted stage comes back where the gateway expects it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from recpipe.serving.config import METRICS_PORT_OFFSET
from recpipe.serving.supervisor import StageProcess, free_port

#: --stage all: the order stage ports follow the gateway's.
PORT_ORDER = ("gateway", "features", "retrieval", "ranking")


def metrics_port(flag: int | None, grpc_port: int, offset: int) -> int | None:
    if flag is None:
        return grpc_port + METRICS_PORT_OFFSET if grpc_port else 0
    if flag < 0:
        return None
    return flag + offset if flag else 0


def allocate_ports(host: str, base: int, metrics_flag: int | None) -> tuple[dict[str, int], dict[str, int | None]]:
    """gRPC and metrics ports per stage for --stage all: gateway ``base``, the others the next three;
    ``base`` 0 picks free ports. Metrics: gRPC port + 1000, or from ``metrics_flag`` (0 free, -1 off)."""
    ports = {s: (base + i if base else free_port(host)) for i, s in enumerate(PORT_ORDER)}
    if metrics_flag == 0 or (metrics_flag is None and not base):
        return ports, {s: free_port(host) for s in PORT_ORDER}
    return ports, {s: metrics_port(metrics_flag, ports[s], i) for i, s in enumerate(PORT_ORDER)}


def connect_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine (a wildcard is not a destination)."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


def supervised_stages(
    *, models: Path, data: Path, host: str, ports: dict[str, int], metrics: dict[str, int | None],
    device: str = "auto", threads: int = 0, workers: int = 0, grace: float = 5.0, log_level: str = "WARNING",
    extra: Sequence[str] = (),
) -> list[StageProcess]:
    """One ``StageProcess`` per stage: ``python -m recpipe serve --stage NAME`` with explicit ports, so
    a restarted stage comes back where the gateway expects it. ``extra`` is appended to every stage's
    arguments (the batching and admission flags)."""
    connect = connect_host(host)
    specs = []
    for name in ("features", "retrieval", "ranking", "gateway"):
        argv = [
            sys.executable, "-m", "recpipe", "--log-level", log_level, "serve", "--stage", name,
            "--models", str(models), "--data", str(data), "--host", host, "--port", str(ports[name]),
            "--metrics-port", str(-1 if metrics[name] is None else metrics[name]),
            "--device", device, "--threads", str(threads), "--workers", str(workers), "--grace", str(grace),
            *extra,
        ]
        if name == "gateway":
            for s in ("features", "retrieval", "ranking"):
                argv += [f"--{s}", f"{connect}:{ports[s]}"]
        specs.append(StageProcess(name, f"{connect}:{ports[name]}", tuple(argv), metrics[name]))
    return specs
