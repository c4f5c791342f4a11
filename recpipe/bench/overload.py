"""Overload: the chain at its SLO rate, then at 3x that rate, then idle again; what is shed, how fast.

Starts the four stages as their own processes (or uses --target) and offers open-loop Poisson load
(latency from the scheduled send time) in three phases: ``--rate`` for ``--base-s`` seconds (the
reference), ``--factor`` x ``--rate`` for ``--overload-s`` seconds, then single queries every 50 ms
for ``--recovery-s`` seconds. It reports the status codes of each phase, how fast refused queries were
answered (RESOURCE_EXHAUSTED, from their send), the accepted queries' p99 against the reference p99,
how long after the overload the latency was back to normal, and each stage process's RSS growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_MODELS_DIR
from recpipe.errors import UsageError
from recpipe.gateway.spec import DEFAULT_MAX_IN_FLIGHT

#: The issue's targets.
SHED_P99_MS = 5.0
ACCEPTED_P99_RATIO = 2.0
RECOVERY_S = 2.0
RSS_GROWTH_MB = 50.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR))
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--target", default=None, help="measure this running gateway instead of starting one")
    parser.add_argument("--rate", type=float, required=True, help="the SLO rate (queries/s), e.g. from "
                        "`recpipe querygen --slo-p99-ms 50`")
    parser.add_argument("--factor", type=float, default=3.0, help="overload = factor x rate (default %(default)s)")
    parser.add_argument("--base-s", type=float, default=10.0)
    parser.add_argument("--overload-s", type=float, default=15.0)
    parser.add_argument("--recovery-s", type=float, default=5.0)
    parser.add_argument("--num-candidates", type=int, default=500)
    parser.add_argument("--timeout", type=float, default=0.5, help="per-query deadline, s (default %(default)s)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="compute threads per stage (0 = library default)")
    parser.add_argument("--max-batch", type=int, default=0, help="the stages' --max-batch (0 = auto)")
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT)
    parser.add_argument("--workers", type=int, default=1, help="stage --workers (1: core calls on a thread)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")


def run(args: argparse.Namespace) -> int:
    if args.rate <= 0 or args.factor < 1 or min(args.base_s, args.overload_s, args.recovery_s) <= 0:
        raise UsageError("--rate and the phase durations must be > 0, --factor >= 1")
    from recpipe.config import DEFAULT_HOST
    from recpipe.serving.launch import allocate_ports, supervised_stages
    from recpipe.serving.supervisor import Supervisor
    from recpipe.stages import REGISTRY

    supervisor = None
    target = args.target
    if target is None:
        for path, what in ((args.models, "--models"), (args.data, "--data")):
            if not Path(path).is_dir():
                raise UsageError(f"{what} {path}: no such directory")
        ports, metrics = allocate_ports(REGISTRY, DEFAULT_HOST, 0, -1)
        extra = ["--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
                 "--max-in-flight", str(args.max_in_flight)]
        stages = supervised_stages(REGISTRY, models=args.models, data=args.data, host=DEFAULT_HOST, ports=ports,
                                   metrics=metrics, device=args.device, threads=args.threads,
                                   workers=args.workers, extra=extra)
        supervisor = Supervisor(stages)
        supervisor.start()
        target = supervisor.addresses()[REGISTRY.entry.name]
    try:
        pids = {} if supervisor is None else {s: supervisor.pid(s) for s in supervisor.addresses()}
        report = asyncio.run(_phases(args, target, pids))
    finally:
        if supervisor is not None:
            supervisor.stop()
    _print(args, report)
    if args.out is not None:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(args.out)
    return 0


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _phases(args: argparse.Namespace, target: str, pids: dict[str, int | None]) -> dict[str, Any]:
    import grpc

    from recpipe.querygen.clients import connect, get_info
    from recpipe.v1 import recommend_pb2, recommend_pb2_grpc

    channel = await connect(target, 30.0)
    info = await get_info(channel) or {}
    num_users = int(info.get("details", {}).get("num_users", 0) or 1000)
    stub = recommend_pb2_grpc.RecommendServiceStub(channel)
    rng = np.random.default_rng(args.seed)

    async def one(results: list[tuple[str, float, float]], due: float) -> None:
        sent = time.perf_counter()
        request = recommend_pb2.RecommendRequest(user_id=int(rng.integers(num_users)),
                                                 num_candidates=args.num_candidates)
        try:
            await stub.Recommend(request, timeout=args.timeout)
            code = "OK"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
        done = time.perf_counter()
        results.append((code, done - due, done - sent))

    async def open_loop(rate: float, seconds: float) -> list[tuple[str, float, float]]:
        results: list[tuple[str, float, float]] = []
        gaps = rng.exponential(1.0 / rate, size=int(rate * seconds * 1.5) + 10)
        start = time.perf_counter() + 0.02
        tasks = []
        for t in np.cumsum(gaps):
            if t > seconds:
                break
            due = start + float(t)
            while (left := due - time.perf_counter()) > 0:
                await asyncio.sleep(left)
            tasks.append(asyncio.create_task(one(results, due)))
        await asyncio.gather(*tasks)
        return results

    # warm up (model first calls, channels), then the three phases
    await open_loop(min(args.rate, 20.0), 2.0)
    rss_before = {s: _rss_mb(p) for s, p in pids.items()}
    base = await open_loop(args.rate, args.base_s)
    over_start = time.perf_counter()
    over = await open_loop(args.rate * args.factor, args.overload_s)
    over_end = time.perf_counter()
    rss_after = {s: _rss_mb(p) for s, p in pids.items()}
    probes: list[tuple[float, str, float]] = []
    end = over_end + args.recovery_s
    while time.perf_counter() < end:
        results: list[tuple[str, float, float]] = []
        due = time.perf_counter()
        await one(results, due)
        probes.append((due - over_end, results[0][0], results[0][2]))
        await asyncio.sleep(0.05)
    await channel.close(None)

    def ok_ms(rows: list[tuple[str, float, float]], q: float) -> float:
        lat = [r[1] * 1e3 for r in rows if r[0] == "OK"]
        return float(np.percentile(lat, q)) if lat else float("nan")

    base_p50, base_p99 = ok_ms(base, 50), ok_ms(base, 99)
    normal_ms = max(2 * base_p50, base_p99)
    # back to normal: from the first probe after which every probe is OK and within the reference p99
    recovered_at = 0.0
    for t, code, lat in probes:
        if code != "OK" or lat * 1e3 > normal_ms:
            recovered_at = t + 0.05
    shed = [r[2] * 1e3 for r in over if r[0] == "RESOURCE_EXHAUSTED"]
    return {
        "target": target, "rate": args.rate, "factor": args.factor, "timeout_s": args.timeout,
        "num_candidates": args.num_candidates, "overload_s": round(over_end - over_start, 2),
        "base": {"queries": len(base), "codes": dict(Counter(r[0] for r in base)), "p50_ms": base_p50,
                 "p99_ms": base_p99},
        "overload": {"queries": len(over), "codes": dict(Counter(r[0] for r in over)),
                     "accepted_p50_ms": ok_ms(over, 50), "accepted_p99_ms": ok_ms(over, 99),
                     "shed_p50_ms": float(np.percentile(shed, 50)) if shed else None,
                     "shed_p99_ms": float(np.percentile(shed, 99)) if shed else None},
        "recovery": {"probes": len(probes), "normal_ms": normal_ms, "back_to_normal_s": round(recovered_at, 3),
                     "codes": dict(Counter(p[1] for p in probes))},
        "rss_mb": {s: {"before": rss_before[s], "after": rss_after[s]} for s in pids},
    }


def _print(args: argparse.Namespace, r: dict[str, Any]) -> None:
    b, o, rec = r["base"], r["overload"], r["recovery"]
    print(f"recpipe bench overload: {args.rate:g} q/s for {args.base_s:g} s, then {args.rate * args.factor:g} q/s "
          f"({args.factor:g}x) for {args.overload_s:g} s; deadline {args.timeout * 1e3:.0f} ms, "
          f"num_candidates {args.num_candidates}")
    print(f"  at the SLO rate : {b['queries']} queries {b['codes']}; p50 {b['p50_ms']:.1f} ms, p99 {b['p99_ms']:.1f} ms")
    print(f"  overload        : {o['queries']} queries {o['codes']}")
    internal = o["codes"].get("INTERNAL", 0) + o["codes"].get("UNKNOWN", 0)
    print(f"    INTERNAL/UNKNOWN: {internal} ({'ok' if internal == 0 else 'MISS'})")
    if o["shed_p50_ms"] is not None:
        mark = "ok" if o["shed_p99_ms"] <= SHED_P99_MS else "MISS"
        print(f"    shed (RESOURCE_EXHAUSTED) answered in p50 {o['shed_p50_ms']:.2f} ms, p99 {o['shed_p99_ms']:.2f} ms "
              f"(target <= {SHED_P99_MS:g} ms: {mark})")
    ratio = o["accepted_p99_ms"] / b["p99_ms"] if b["p99_ms"] else float("nan")
    print(f"    accepted p50 {o['accepted_p50_ms']:.1f} ms, p99 {o['accepted_p99_ms']:.1f} ms = {ratio:.2f}x the SLO-rate "
          f"p99 (target <= {ACCEPTED_P99_RATIO:g}x: {'ok' if ratio <= ACCEPTED_P99_RATIO else 'MISS'})")
    mark = "ok" if rec["back_to_normal_s"] <= RECOVERY_S else "MISS"
    print(f"  recovery        : back under {rec['normal_ms']:.1f} ms {rec['back_to_normal_s']:.2f} s after the overload "
          f"(target <= {RECOVERY_S:g} s: {mark}); probes {rec['codes']}")
    for stage, m in r["rss_mb"].items():
        if m["before"] is not None and m["after"] is not None:
            growth = m["after"] - m["before"]
            print(f"  RSS {stage:<10}: {m['before']:.0f} -> {m['after']:.0f} MB (+{growth:.0f}; target <= "
                  f"{RSS_GROWTH_MB:g}: {'ok' if growth <= RSS_GROWTH_MB else 'MISS'})")
