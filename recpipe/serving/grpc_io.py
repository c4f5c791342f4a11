"""Which of gRPC core's two I/O paths recpipe's processes use.

grpcio 1.85 moves a call's socket reads and writes onto the EventEngine (its ``event_engine_client``
and ``event_engine_listener`` experiments, on by default): the bytes are read on the engine's own
threads and handed over to the thread that polls the completion queue, which grpc.aio hands over to
the event loop, one more thread wake-up per event. gRPC core's older I/O path (iomgr) reads them on
the polling thread itself. Both are gRPC's own, selected with its ``GRPC_EXPERIMENTS`` variable, which
core reads once, when ``grpc`` is imported.

Measured on the 2-core EPYC VM (BENCHMARKS.md, "Batched hops and replicas"):

- a bare grpc.aio unary echo, 100 bytes: client CPU 160 -> 110-120 us per call, server 245 -> 200-210 us;
- ``recpipe bench querygen`` at 12,000 q/s: 2 sender processes 8,298 / 7,979 -> 9,471 / 9,255 q/s
  (generator CPU 148-153 -> 121-129 us per query, the fixed-reply target's 74-76 -> 69-70);
- the chain, closed loop of 8: serving CPU per query, median of 5 alternating rounds, 2.84 -> 2.64 ms.

So ``prefer_iomgr`` (called by the CLI before anything imports grpc, so every recpipe process and the
processes it starts inherit it) chooses the older path, unless the user has set ``GRPC_EXPERIMENTS``
(an empty value keeps gRPC's defaults) or the grpcio installed is not one whose cost was measured: a
newer one may have removed these experiments (grpc/grpc#43350 removes ``event_engine_client``), and
core logs an error line for each name it does not know.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

#: gRPC core's experiment switches, read once when ``grpc`` is imported
ENV = "GRPC_EXPERIMENTS"
#: the EventEngine endpoint experiments off: sockets read and written by iomgr on the polling thread
IOMGR = "-event_engine_client,-event_engine_listener"
#: the grpcio (major, minor) versions measured to cost less on iomgr, whose core knows both names
MEASURED = frozenset({(1, 85)})


def grpcio_version() -> tuple[int, int] | None:
    """The installed grpcio's (major, minor), without importing it; None where unknown."""
    try:
        major, minor = metadata.version("grpcio").split(".")[:2]
        return int(major), int(minor)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def prefer_iomgr(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """Choose gRPC core's iomgr I/O path for this process and its children (see the module doc); what
    was decided, in words."""
    if ENV in environ:
        return f"{ENV}={environ[ENV]!r} (set by the user)"
    if "grpc" in sys.modules:
        return f"gRPC's defaults ({ENV} is read when grpc is imported, and it already was)"
    version = grpcio_version()
    if version not in MEASURED:
        return f"gRPC's defaults (grpcio {version}: not measured)"
    environ[ENV] = IOMGR
    return f"{ENV}={IOMGR}"
