"""One gRPC hop: a bare grpc.aio echo against a recpipe stage hop with the same payload, same run.

A server process hosts both: a bare ``grpc.aio`` server whose one generic method returns a reply of
the size a Rank reply has (no interceptor, health or reflection), and the real ranking stage
(``StageServer``: interceptor, metrics, health, reflection; the Rank servicer: decode, contract,
batcher, encode) over a core whose batch call costs nothing, so what is left is the hop itself. The
client sends the same RankRequest bytes (``--candidates`` items) to both, alternating call by call so
both see the same machine noise, and prints p50/p99 of each and the stage hop's overhead over the echo.

With ``--idle-calls N`` it then times N more of each after ``--idle-ms`` of sleep before every call:
a lone query meets processes that went idle between its hops, and waking them (a thread blocked in
epoll, a halted virtual CPU, a core in a deep sleep state) is the platform's cost, not gRPC's. On the
2-core Firecracker VM (``--calls 300 --idle-calls 100``) the bare echo took 0.85 ms back to back and
1.73 ms after 5 ms idle at p50. The stage's own handler is timed after idle too: on the bf16 VM
(``--calls 1000 --idle-calls 200 --max-batch 1``) it took 264 µs against 100 back to back, so a lone
query's stages also run their own code slower (caches and the core gone cold), not only wake later.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from recpipe import schema
from recpipe.bench._args import at_least, within
from recpipe.config import MAX_NUM_CANDIDATES
from recpipe.errors import UsageError
from recpipe.percentiles import percentile, percentiles

#: The issue's target: a recpipe hop costs at most 1.25x the bare echo.
TARGET_RATIO = 1.25
_ECHO_METHOD = "/bench.Echo/Echo"
USER_DENSE, ITEM_DENSE = 43, 26  # the full-scale schema's dense widths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per form (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--candidates", type=int, default=500, help="items in the payload (default %(default)s)")
    parser.add_argument("--max-batch", type=int, default=32, help="the stage's batcher (1 = off)")
    parser.add_argument("--idle-calls", type=int, default=0,
                        help="then this many calls of each form after --idle-ms of idle each (default 0: none)")
    parser.add_argument("--idle-ms", type=float, default=5.0,
                        help="the idle time before each --idle-calls call (default %(default)s)")
    parser.add_argument("--workers", type=int, default=0,
                        help="the stage's --workers: 0 = core calls inline on the loop (the free core's calls "
                             "are predicted short, after the first), 1 = on a thread")


class _FreeRankingCore:
    """A ranking core with the real limits and no work: scores are zeros."""

    device = "cpu"
    model_version = "bench-hop"
    user_dense_dim = USER_DENSE
    item_dense_dim = ITEM_DENSE

    @property
    def limits(self) -> Any:
        from recpipe.ranking.contract import RankingLimits

        return RankingLimits(USER_DENSE, ITEM_DENSE, np.full(len(schema.USER_CATEGORICAL), 10, np.int64),
                             np.full(len(schema.ITEM_CATEGORICAL), 10, np.int64))

    def rank_batch(self, queries: Sequence[Any]) -> list[np.ndarray]:
        return [np.zeros(q.k, np.float32) for q in queries]


def _serve(ports: Any, reply_bytes: int, max_batch: int, workers: int) -> None:
    import grpc
    from grpc import aio

    from recpipe.ranking.servicer import RankingStage
    from recpipe.serving.batcher import BatchConfig
    from recpipe.serving.server import StageServer

    async def main() -> None:
        reply = b"\0" * reply_bytes

        async def echo(request: bytes, context: aio.ServicerContext) -> bytes:
            return reply

        bare = aio.server()
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
        bare.add_generic_rpc_handlers((handler,))
        echo_port = bare.add_insecure_port("127.0.0.1:0")
        await bare.start()
        stage = RankingStage(_FreeRankingCore, workers=workers,
                             batch=BatchConfig(max_batch=max_batch, max_queue=max(256, max_batch)))
        server = await StageServer.start(stage, port=0)
        await server.load()
        ports.put((echo_port, server.port))
        await asyncio.Event().wait()

    asyncio.run(main())


def run(args: argparse.Namespace) -> int:
    at_least(10, ("--calls", args.calls))
    at_least(0, ("--warmup", args.warmup), ("--workers", args.workers))
    within(1, MAX_NUM_CANDIDATES, ("--candidates", args.candidates))
    at_least(1, ("--max-batch", args.max_batch))
    if args.idle_calls != 0 and args.idle_calls < 10:
        raise UsageError(f"--idle-calls must be 0 or >= 10, got {args.idle_calls}")
    if not 0 < args.idle_ms <= 1000:
        raise UsageError(f"--idle-ms must be in (0, 1000], got {args.idle_ms}")
    from recpipe.serving import codec
    from recpipe.v1 import ranking_pb2

    rng = np.random.default_rng(0)
    k = args.candidates
    request = ranking_pb2.RankRequest(
        user_dense=codec.encode(rng.normal(size=USER_DENSE).astype(np.float32)),
        user_sparse=codec.encode(rng.integers(0, 10, len(schema.USER_CATEGORICAL))),
        item_dense=codec.encode(rng.normal(size=(k, ITEM_DENSE)).astype(np.float32)),
        item_sparse=codec.encode(rng.integers(0, 10, (k, len(schema.ITEM_CATEGORICAL)))),
    )
    reply_bytes = ranking_pb2.RankResponse(scores=codec.encode(np.zeros(k, np.float32)), server_us=1000,
                                           model_version="bench-hop", queue_us=10, compute_us=10,
                                           batch_size=1).ByteSize()
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(ports, reply_bytes, args.max_batch, args.workers), daemon=True)
    proc.start()
    try:
        echo_port, stage_port = ports.get(timeout=120)
        echo_ns, stage_ns, handler_ns, queue_ns = asyncio.run(_measure(echo_port, stage_port, request, args.calls, args.warmup))
        # a few untimed calls first: the idle form opens its own channels
        idle = (asyncio.run(_measure(echo_port, stage_port, request, args.idle_calls, 3, args.idle_ms / 1000))
                if args.idle_calls else None)
    finally:
        proc.terminate()
        proc.join(10)
    echo_p50, stage_p50 = percentile(echo_ns, 50, scale=1e3), percentile(stage_ns, 50, scale=1e3)
    ratio = stage_p50 / echo_p50
    print(f"recpipe bench hop: {args.calls} calls each (+{args.warmup} warm-up), alternating; payload "
          f"{request.ByteSize():,} B request ({k} candidates), {reply_bytes:,} B reply; stage --workers "
          f"{args.workers}, --max-batch {args.max_batch}")
    print(f"{'hop':<46}{'p50 µs':>10}{'p99 µs':>10}")
    rows = (("bare grpc.aio echo", echo_ns, ""), ("recpipe ranking stage (Rank)", stage_ns, ""),
            ("  of which inside the Rank handler", handler_ns, "   (decode, contract, batcher, encode)"),
            ("  of which in the batcher queue", queue_ns, ""))
    for name, ns, note in rows:
        p50, p99 = percentiles(ns, (50, 99), scale=1e3)
        print(f"{name:<46}{p50:>10.0f}{p99:>10.0f}{note}")
    if idle is not None:
        after = f" after {args.idle_ms:g} ms idle"
        for name, ns in ((f"bare grpc.aio echo{after}", idle[0]), (f"recpipe ranking stage (Rank){after}", idle[1]),
                         ("  of which inside the Rank handler", idle[2])):
            p50, p99 = percentiles(ns, (50, 99), scale=1e3)
            print(f"{name:<46}{p50:>10.0f}{p99:>10.0f}")
    verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
    print(f"stage hop / echo p50 = {ratio:.2f}x ({verdict} the {TARGET_RATIO}x target); overhead over the "
          f"echo floor {stage_p50 - echo_p50:.0f} µs per hop")
    if idle is not None:
        woke = percentile(idle[0], 50, scale=1e3) - echo_p50
        print(f"after {args.idle_ms:g} ms idle the bare echo takes {woke:.0f} µs more at p50 ({args.idle_calls} calls): "
              "waking the idle processes, the platform's cost a lone query pays at every hop")
    return 0


async def _measure(echo_port: int, stage_port: int, request: Any, calls: int, warmup: int,
                   idle_s: float = 0.0) -> tuple[np.ndarray, ...]:
    """``calls`` timed calls of each form, alternating, after ``warmup`` untimed ones; with ``idle_s``, a
    sleep of that long before each call (so each one meets idle processes) -> echo, stage, the stage's
    handler and its batcher queue, in ns."""
    from recpipe.serving.channels import make_channel
    from recpipe.v1 import ranking_pb2, ranking_pb2_grpc

    payload = request.SerializeToString()
    async with make_channel(f"127.0.0.1:{echo_port}") as echo_ch, make_channel(f"127.0.0.1:{stage_port}") as stage_ch:
        echo = echo_ch.unary_unary(_ECHO_METHOD, None, None)  # raw bytes both ways
        rank = ranking_pb2_grpc.RankingServiceStub(stage_ch).Rank
        samples = np.zeros((4, calls), dtype=np.int64)
        for i in range(warmup + calls):
            if idle_s:
                await asyncio.sleep(idle_s)
            t0 = time.perf_counter_ns()
            await echo(payload, timeout=10)
            echo_ns = time.perf_counter_ns() - t0
            if idle_s:
                await asyncio.sleep(idle_s)
            t1 = time.perf_counter_ns()
            reply: ranking_pb2.RankResponse = await rank(request, timeout=10)
            t2 = time.perf_counter_ns()
            if i >= warmup:
                samples[:, i - warmup] = (echo_ns, t2 - t1, reply.server_us * 1000, reply.queue_us * 1000)
        assert len(reply.scores.data) == 4 * len(request.item_dense.data) // (4 * ITEM_DENSE)
    return samples[0], samples[1], samples[2], samples[3]
