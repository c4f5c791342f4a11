"""Which of gRPC core's two I/O paths recpipe's processes use.

grpcio 1.85 runs a call's socket reads and writes on its EventEngine (the ``event_engine_client`` and
``event_engine_listener`` experiments, on by default); gRPC core's older I/O path, iomgr, is still
built in. Both are gRPC's own, chosen with its ``GRPC_EXPERIMENTS`` variable, which core reads once,
when ``grpc`` is imported. On this project's calls iomgr costs less CPU per call. Where it goes was
not traced: the voluntary context switches per call are the same on both paths (1.05 in the client,
2.4-2.7 in the server, one call at a time), so it is the path's own work, not extra thread wake-ups.

Measured on the 2-core EPYC VM, alternating (BENCHMARKS.md, "Batched hops and replicas"):

- a bare grpc.aio unary echo of 2 kB, 8 calls at once, 3 rounds: client CPU per call 113-144 -> 85-96
  us, server 156-186 -> 143-164 us; one call at a time, 2 rounds: client 190-196 -> 124-144 us, server
  318-325 -> 240-255 us;
- the chain, closed loop of 8, 5 rounds: serving CPU per query 2.84 -> 2.64 ms (medians; 4 of 5 pairs
  lower);
- the chain in open loop at 250 and 300 q/s (batches of 1-3): 4.79 -> 4.88 and 4.28 -> 4.22 ms, within
  the host's noise; p99 likewise.

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
