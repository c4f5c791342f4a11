"""Ask a recpipe server's gRPC health service whether it is SERVING; exit 0 if so, 1 if not.

    python -m recpipe.serving.healthcheck [TARGET] [--service NAME] [--timeout SECONDS]

TARGET defaults to ``$RECPIPE_HEALTH_TARGET``, else the gateway's default address. Container
healthchecks (docker-compose.yml) run this inside each stage's container: the image has no
grpc_health_probe binary, and the Python client is already installed. A stage reports SERVING only
after its state is loaded, so "healthy" means "ready for traffic", not merely "process up"; the
gateway reports SERVING only while every stage it calls does (``recpipe.gateway.readiness``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from recpipe.config import DEFAULT_HOST, DEFAULT_PORT
from recpipe.errors import UsageError

TARGET_ENV = "RECPIPE_HEALTH_TARGET"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m recpipe.serving.healthcheck", description="Exit 0 when a recpipe server reports SERVING.")
    parser.add_argument("target", nargs="?", default=None,
                        help=f"HOST:PORT (default ${TARGET_ENV}, else {DEFAULT_HOST}:{DEFAULT_PORT})")
    parser.add_argument("--service", default="", help="the service name to ask about ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    return parser


def check(target: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(serving?, a one-line description) for ``service`` on the server at ``target``."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from recpipe.config import normalize_target
    from recpipe.serving.channels import make_blocking_channel

    target = normalize_target(target)
    t0 = time.monotonic()
    with make_blocking_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, (f"{target}: {e.code().name} after {time.monotonic() - t0:.2f} s "
                           f"(timeout {timeout:g} s): {e.details()}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    return answer.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    """0 when SERVING, 1 when not (or unreachable), 2 for bad arguments."""
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if args.timeout <= 0:
            raise UsageError(f"--timeout must be > 0, got {args.timeout}")
        target = args.target or os.environ.get(TARGET_ENV) or f"{DEFAULT_HOST}:{DEFAULT_PORT}"
    except UsageError as e:
        print(f"recpipe.serving.healthcheck: error: {e}", file=sys.stderr)
        return 2
    serving, line = check(target, args.service, args.timeout)
    print(line, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
