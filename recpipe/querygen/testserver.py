"""A real grpc.aio server that answers like the recpipe chain, with delays and stalls under control.

It serves RecommendService (returning a StageTiming per stage), the three stage services (so
``--per-component`` can be exercised without trained models) and InfoService (``details["num_users"]``),
all on one port. Each stage takes exactly its configured delay; a stall (SIGUSR1, or every
``stall_every`` seconds) freezes the server's event loop, as a garbage-collection pause or a descheduled
process would, so every query in flight or arriving meanwhile waits. It is the reference the query generator's accuracy tests measure against, and
the trivial server of ``recpipe bench querygen``.

Run alone: ``python -m recpipe.querygen.testserver --port 0 --delay-ms rank=5`` prints ``PORT <n>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio
import numpy as np

from recpipe.config import STEPS, TOTAL_STEP
from recpipe.errors import UsageError
from recpipe.querygen import frametarget, loops
from recpipe.serving import codec
from recpipe.v1 import (
    features_pb2,
    features_pb2_grpc,
    info_pb2,
    info_pb2_grpc,
    ranking_pb2,
    ranking_pb2_grpc,
    recommend_pb2,
    recommend_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)

_USER_DENSE = 8
_ITEM_DENSE = 4
_SPIN_S = 0.0015
#: how much slower the slow blocks of ``alternate_every`` are
SLOW_FACTOR = 4.0


@dataclass(frozen=True)
class TestServerConfig:
    """Per-stage delays in seconds (stages not named take none) and the user-id range it reports."""

    __test__ = False  # not a pytest class

    delays: Mapping[str, float] = field(default_factory=dict)
    num_users: int = 1000
    #: every ``stall_every`` seconds (0 = never) the server freezes for ``stall_for`` seconds
    stall_every: float = 0.0
    stall_for: float = 0.0
    #: serve one query at a time (like a single-threaded CPU stage): capacity 1 / sum(delays), and a
    #: queue -- and a tail -- forms as the offered rate approaches it
    serial: bool = False
    #: per-stage seconds each request waits "queued" before its delay (reported as queue_us, the delay
    #: as compute_us, batch_size 1), so the queue/compute split can be checked end to end
    queue_delays: Mapping[str, float] = field(default_factory=dict)
    #: > 0: Recommend calls come in blocks of this many, alternately at the configured delays and at
    #: ``SLOW_FACTOR`` times them (a server whose latency never settles, for the stability loop)
    alternate_every: int = 0
    #: answer every Recommend with one response serialized at start, through a generic handler (no
    #: request decode, no response build, no delays): the cheapest target a Python gRPC server can be,
    #: so that a benchmark of the generator runs out of the generator's CPU before the target's
    fixed_reply: bool = False
    #: the fixed reply written at the HTTP/2 frame level (``recpipe.querygen.frametarget``) instead of by
    #: grpc.aio: a fraction of its CPU per query, and no service but the reply
    frames: bool = False

    def __post_init__(self) -> None:
        if self.frames and not self.fixed_reply:
            raise UsageError("--frames is a form of --fixed-reply")
        if self.fixed_reply and (self.delays or self.queue_delays or self.serial or self.alternate_every
                                 or self.stall_every):
            raise UsageError("the fixed reply takes no delays, stalls, --serial or --alternate-every")
        unknown = (set(self.delays) | set(self.queue_delays)) - set(STEPS)
        if unknown:
            raise UsageError(f"unknown stage(s) {sorted(unknown)}; stages are {', '.join(STEPS)}")
        if any(d < 0 for d in (*self.delays.values(), *self.queue_delays.values())):
            raise UsageError("stage delays must be >= 0")


class _Servicer(
    recommend_pb2_grpc.RecommendServiceServicer,
    features_pb2_grpc.FeatureServiceServicer,
    retrieval_pb2_grpc.RetrievalServiceServicer,
    ranking_pb2_grpc.RankingServiceServicer,
    info_pb2_grpc.InfoServiceServicer,
):
    def __init__(self, config: TestServerConfig) -> None:
        self.config = config
        rng = np.random.default_rng(0)
        self._user_dense = codec.encode(rng.random(_USER_DENSE, dtype=np.float32))
        self._user_sparse = codec.encode(np.arange(44, dtype=np.int64))
        self._recent = codec.encode(np.full(4, -1, dtype=np.int64))
        self._lock = asyncio.Lock() if config.serial else None
        self._calls = 0

    @staticmethod
    async def _spend(seconds: float) -> None:
        t0 = time.perf_counter()
        if seconds > 0:
            # A loaded machine wakes sleepers up to a millisecond or more late; the reference must not,
            # so it sleeps most of the delay and spins the rest.
            await loops.sleep_until(t0 + seconds - _SPIN_S)
            while time.perf_counter() < t0 + seconds:
                pass

    async def _timed(self, stage: str, factor: float = 1.0) -> tuple[int, int, int]:
        """Spend the stage's queue delay, then its delay: ``(server_us, queue_us, compute_us)``."""
        t0 = time.perf_counter()
        await self._spend(self.config.queue_delays.get(stage, 0.0) * factor)
        t1 = time.perf_counter()
        await self._spend(self.config.delays.get(stage, 0.0) * factor)
        t2 = time.perf_counter()
        return int((t2 - t0) * 1e6), int((t1 - t0) * 1e6), int((t2 - t1) * 1e6)

    async def _stage(self, stage: str) -> int:
        """Spend exactly the stage's delay (and queue delay); returns the microseconds spent."""
        return (await self._timed(stage))[0]

    async def Recommend(self, request, context):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        timings = []
        every = self.config.alternate_every
        factor = SLOW_FACTOR if every and (self._calls // every) % 2 else 1.0
        self._calls += 1
        async with self._lock or contextlib.nullcontext():
            for stage in STEPS:
                us, queue_us, compute_us = await self._timed(stage, factor)
                # In-process stages: no network hop, so what the "gateway" observes is the server time.
                timings.append(recommend_pb2.StageTiming(stage=stage, server_us=us, observed_us=us,
                                                         queue_us=queue_us, compute_us=compute_us,
                                                         batch_size=1))
        k = request.num_candidates or 500
        n = min(request.num_results or 10, k)
        total = int((time.perf_counter() - t0) * 1e6)
        timings.append(recommend_pb2.StageTiming(stage=TOTAL_STEP, server_us=total, observed_us=total))
        return recommend_pb2.RecommendResponse(
            item_ids=list(range(n)), scores=[1.0 / (j + 1) for j in range(n)], timings=timings,
            model_version="testserver")

    async def AugmentUser(self, request, context):  # type: ignore[no-untyped-def]
        us = await self._stage("augment_user")
        return features_pb2.AugmentUserResponse(
            user_id=request.user_id, dense=self._user_dense, sparse=self._user_sparse,
            recent_items=self._recent, server_us=us)

    async def Retrieve(self, request, context):  # type: ignore[no-untyped-def]
        us = await self._stage("retrieve")
        k = request.k or 500
        return retrieval_pb2.RetrieveResponse(
            item_ids=codec.encode(np.arange(k, dtype=np.int64)),
            scores=codec.encode(np.linspace(1.0, 0.0, k, dtype=np.float32)), server_us=us,
            model_version="testserver")

    async def AugmentItems(self, request, context):  # type: ignore[no-untyped-def]
        us = await self._stage("augment_items")
        k = int(request.item_ids.shape[0]) if request.item_ids.shape else 0
        return features_pb2.AugmentItemsResponse(
            dense=codec.encode(np.zeros((k, _ITEM_DENSE), dtype=np.float32)),
            sparse=codec.encode(np.zeros((k, 16), dtype=np.int64)), server_us=us)

    async def Rank(self, request, context):  # type: ignore[no-untyped-def]
        us = await self._stage("rank")
        k = int(request.item_dense.shape[0]) if request.item_dense.shape else 0
        scores = np.random.default_rng(k).random(k, dtype=np.float32)
        return ranking_pb2.RankResponse(scores=codec.encode(scores), server_us=us, model_version="testserver")

    async def GetInfo(self, request, context):  # type: ignore[no-untyped-def]
        return info_pb2.ServiceInfo(
            stage="gateway", device="cpu", model_version="testserver", threads=1,
            details={"num_users": str(self.config.num_users), "test_server": "true"})


def fixed_reply_bytes() -> bytes:
    """The serialized RecommendResponse of ``fixed_reply``: shaped like a real one (10 items, a timing per
    stage with its queue/compute split, the total), so the generator does its usual work on it."""
    timings = [recommend_pb2.StageTiming(stage=stage, server_us=1, observed_us=1, queue_us=0, compute_us=1,
                                         batch_size=1) for stage in STEPS]
    timings.append(recommend_pb2.StageTiming(stage=TOTAL_STEP, server_us=len(STEPS), observed_us=len(STEPS)))
    return recommend_pb2.RecommendResponse(
        item_ids=list(range(10)), scores=[1.0 / (j + 1) for j in range(10)], timings=timings,
        model_version="testserver").SerializeToString()


def _fixed_recommend_handler() -> grpc.GenericRpcHandler:
    reply = fixed_reply_bytes()

    async def recommend(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return reply

    # No (de)serializers: the handler sees and returns raw bytes.
    service = recommend_pb2.DESCRIPTOR.services_by_name["RecommendService"].full_name
    return grpc.method_handlers_generic_handler(service, {"Recommend": grpc.unary_unary_rpc_method_handler(recommend)})


async def start_server(config: TestServerConfig, port: int = 0,
                       host: str = "127.0.0.1") -> tuple[grpc.aio.Server, int]:
    """Start the test server on the running loop; returns ``(server, bound_port)``."""
    server = grpc.aio.server()
    servicer = _Servicer(config)
    if config.fixed_reply:
        server.add_generic_rpc_handlers((_fixed_recommend_handler(),))
    else:
        recommend_pb2_grpc.add_RecommendServiceServicer_to_server(servicer, server)
    features_pb2_grpc.add_FeatureServiceServicer_to_server(servicer, server)
    retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(servicer, server)
    ranking_pb2_grpc.add_RankingServiceServicer_to_server(servicer, server)
    info_pb2_grpc.add_InfoServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound


def _freeze(seconds: float) -> None:
    # Blocking on purpose: the whole event loop stops, like a stop-the-world pause.
    time.sleep(seconds)


class TestServerProcess:
    """The test server in its own process (it must not share a GIL with the generator it measures).

    ``stall()`` sends SIGUSR1, which freezes the server's event loop for ``stall_for`` seconds; queries
    keep arriving in the gRPC core and wait, exactly as they would for a paused process.
    """

    __test__ = False

    def __init__(self, config: TestServerConfig) -> None:
        self.config = config
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout: float = 30.0) -> TestServerProcess:
        argv = [sys.executable, "-m", "recpipe.querygen.testserver", "--port", "0",
                "--num-users", str(self.config.num_users), "--stall-ms", str(self.config.stall_for * 1000),
                "--stall-every-s", str(self.config.stall_every)]
        if self.config.serial:
            argv.append("--serial")
        for stage, seconds in self.config.delays.items():
            argv += ["--delay-ms", f"{stage}={seconds * 1000!r}"]
        if self.config.alternate_every:
            argv += ["--alternate-every", str(self.config.alternate_every)]
        if self.config.fixed_reply:
            argv.append("--fixed-reply")
        if self.config.frames:
            argv.append("--frames")
        for stage, seconds in self.config.queue_delays.items():
            argv += ["--queue-ms", f"{stage}={seconds * 1000!r}"]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        deadline = time.monotonic() + timeout
        ready = threading.Event()
        line: list[str] = []

        def read_port() -> None:
            assert self._proc is not None and self._proc.stdout is not None
            line.append(self._proc.stdout.readline())
            ready.set()

        threading.Thread(target=read_port, daemon=True).start()
        ready.wait(max(0.0, deadline - time.monotonic()))
        if not line or not line[0].startswith("PORT "):
            self.stop()
            raise RuntimeError(f"test server did not start: {line[0] if line else 'timeout'!r}")
        self.port = int(line[0].split()[1])
        return self

    def stall(self) -> None:
        """Freeze the server now for ``config.stall_for`` seconds."""
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGUSR1)

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.stdin:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout:
            self._proc.stdout.close()
        self._proc = None

    def __enter__(self) -> TestServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def parse_delays(specs: Sequence[str]) -> dict[str, float]:
    """``["rank=5", "retrieve=1.5"]`` (milliseconds) -> ``{"rank": 0.005, "retrieve": 0.0015}``."""
    out: dict[str, float] = {}
    for spec in specs:
        stage, _, ms = spec.partition("=")
        try:
            out[stage] = float(ms) / 1000
        except ValueError:
            raise UsageError(f"--delay-ms wants STAGE=MS, got {spec!r}") from None
    return out


async def _serve_forever(config: TestServerConfig, port: int) -> None:
    loop = asyncio.get_running_loop()
    stop: Callable[[], Awaitable[None]]
    if config.frames:
        frames, bound = await frametarget.start(fixed_reply_bytes(), port=port)
        stop = functools.partial(frametarget.stop, frames)
    else:
        server, bound = await start_server(config, port)
        stop = functools.partial(server.stop, 0.5)
    print(f"PORT {bound}", flush=True)
    # Installed even without a stall length, so a stray SIGUSR1 never kills the server.
    loop.add_signal_handler(signal.SIGUSR1, _freeze, config.stall_for)
    if config.stall_every > 0:
        def stall_again() -> None:
            _freeze(config.stall_for)
            loop.call_later(config.stall_every, stall_again)

        loop.call_later(config.stall_every, stall_again)
    # Exit when the parent closes our stdin, so a crashed benchmark leaves no server behind.
    await loop.run_in_executor(None, sys.stdin.read)
    await stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recpipe.querygen.testserver", description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-ms", action="append", default=[], metavar="STAGE=MS")
    parser.add_argument("--num-users", type=int, default=1000)
    parser.add_argument("--stall-every-s", type=float, default=0.0)
    parser.add_argument("--stall-ms", type=float, default=0.0)
    parser.add_argument("--serial", action="store_true")
    parser.add_argument("--queue-ms", action="append", default=[], metavar="STAGE=MS")
    parser.add_argument("--alternate-every", type=int, default=0, metavar="N")
    parser.add_argument("--fixed-reply", action="store_true")
    parser.add_argument("--frames", action="store_true",
                        help="with --fixed-reply: answer at the HTTP/2 frame level (recpipe.querygen.frametarget)")
    args = parser.parse_args(argv)
    config = TestServerConfig(parse_delays(args.delay_ms), args.num_users, args.stall_every_s,
                              args.stall_ms / 1000, args.serial, parse_delays(args.queue_ms),
                              args.alternate_every, fixed_reply=args.fixed_reply, frames=args.frames)
    with contextlib.suppress(KeyboardInterrupt):
        loops.run(_serve_forever(config, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
