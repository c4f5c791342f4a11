"""Overload: the chain at its SLO rate, then at 3x that rate, then idle again; what is shed, how fast.
With ``--kill STAGE`` / ``--freeze STAGE``: the outage of a crashed (SIGKILL) or frozen (SIGSTOP) stage.

Starts the four stages as their own processes (or uses --target) and offers open-loop Poisson load
(latency from the scheduled send time) in three phases: ``--rate`` for ``--base-s`` seconds (the
reference), ``--factor`` x ``--rate`` for ``--overload-s`` seconds, then single queries every 50 ms
for ``--recovery-s`` seconds. It reports the status codes of each phase, how fast refused queries were
answered (RESOURCE_EXHAUSTED, from their send), the accepted queries' p99 against the reference p99,
how long after the overload the latency was back to normal, and each stage process's RSS growth. Of
the overload it also reports the goodput (answers per second; against ``--sustained``, the rate the chain
sustains within the deadline, if given), where the refusals came from (the gateway's door, or a stage
after a hop or more) and how many admitted queries still ended in DEADLINE_EXCEEDED.

``--kill``/``--freeze`` replace the phases: at ``--rate`` for ``--outage-s`` seconds, the stage process is
killed (or stopped) two seconds in, while the supervisor does what ``recpipe serve`` does (restarts a
dead or frozen stage). The outage is the time from the signal to the first answer after which every
query is answered; it reports the codes meanwhile and how many queries waited out their whole deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from recpipe.bench._args import above, at_least, check_out, require_dirs, within
from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_MODELS_DIR, MAX_NUM_CANDIDATES
from recpipe.errors import UsageError
from recpipe.files import write_atomic
from recpipe.gateway.options import DEFAULT_MAX_IN_FLIGHT
from recpipe.percentiles import percentile
from recpipe.stages import REGISTRY

#: The issue's targets.
SHED_P99_MS = 5.0
GOODPUT_SHARE = 0.8
EXPIRED_SHARE = 0.01
OUTAGE_S = {"kill": 1.5, "freeze": 5.0}
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
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    parser.add_argument("--sustained", type=float, default=None,
                        help="the rate (q/s) the chain sustains with p99 within the deadline (from `recpipe "
                             "querygen --slo-p99-ms`): the overload's goodput is compared with it")
    fault = parser.add_mutually_exclusive_group()
    fault.add_argument("--kill", metavar="STAGE", choices=REGISTRY.names,
                       help="instead of the overload: SIGKILL this stage at --rate and measure the outage")
    fault.add_argument("--freeze", metavar="STAGE", choices=REGISTRY.names,
                       help="instead of the overload: SIGSTOP this stage at --rate and measure the outage")
    parser.add_argument("--warm-standby", action=argparse.BooleanOptionalAction, default=True,
                        help="--kill/--freeze: the supervisor keeps a loaded standby per stage, as `recpipe serve` "
                             "does by default (default on)")
    parser.add_argument("--outage-s", type=float, default=12.0, help="--kill/--freeze: seconds of load (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    above(0, ("--rate", args.rate), ("--base-s", args.base_s), ("--overload-s", args.overload_s),
          ("--recovery-s", args.recovery_s), ("--timeout", args.timeout), ("--outage-s", args.outage_s))
    at_least(1, ("--factor", args.factor))
    if args.sustained is not None:
        above(0, ("--sustained", args.sustained))
    within(1, MAX_NUM_CANDIDATES, ("--num-candidates", args.num_candidates))
    at_least(0, ("--threads", args.threads), ("--workers", args.workers), ("--seed", args.seed))
    from recpipe.config import DEFAULT_HOST
    from recpipe.gateway.options import GatewayOptions
    from recpipe.serving.batcher import BatchConfig
    from recpipe.serving.launch import allocate_ports, supervised_stages
    from recpipe.serving.supervisor import Supervisor

    BatchConfig(max_batch=args.max_batch, max_queue=args.max_queue)  # the stages' own checks (UsageError)
    GatewayOptions(max_in_flight=args.max_in_flight)
    fault = ("kill", args.kill) if args.kill else ("freeze", args.freeze) if args.freeze else None
    if fault is not None and args.target is not None:
        raise UsageError(f"--{fault[0]} needs the stages this bench starts (not --target)")
    if args.target is None:
        require_dirs(("--models", args.models), ("--data", args.data))
    check_out("--out", args.out, args.force)  # before the run, not after it

    supervisor = None
    target = args.target
    if target is None:
        ports = allocate_ports(REGISTRY, DEFAULT_HOST, 0, -1)
        extra = ["--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
                 "--max-in-flight", str(args.max_in_flight)]
        stages = supervised_stages(REGISTRY, models=args.models, data=args.data, host=DEFAULT_HOST, ports=ports,
                                   device=args.device, threads=args.threads,
                                   workers=args.workers, extra=extra)
        supervisor = Supervisor(stages, standby=fault is not None and args.warm_standby)
        supervisor.start()
        target = supervisor.addresses()[REGISTRY.entry.name]
    try:
        if fault is not None:
            assert supervisor is not None
            report = _outage(args, target, supervisor, *fault)
        else:
            pids = {} if supervisor is None else {s: supervisor.pid(s) for s in supervisor.addresses()}
            report = asyncio.run(_phases(args, target, pids))
    finally:
        if supervisor is not None:
            supervisor.stop()
    (_print_outage if fault is not None else _print)(args, report)
    if args.out is not None:
        write_atomic(args.out, json.dumps(report, indent=2) + "\n", force=args.force)
    return 0


#: A RESOURCE_EXHAUSTED that a stage gave after one hop or more, rather than the gateway at its door.
REFUSED_AFTER_HOPS = "RESOURCE_EXHAUSTED after hops"


def _outage(args: argparse.Namespace, target: str, supervisor: Any, how: str, stage: str) -> dict[str, Any]:
    """Load at ``--rate`` while ``stage`` is killed or frozen two seconds in, the supervisor watching."""
    import os
    import signal
    import threading

    if supervisor.standby and not supervisor.wait_standbys():
        raise UsageError("the stages' warm standbys did not load within 120 s")
    stop = threading.Event()
    watcher = threading.Thread(target=supervisor.run, args=(stop, 0.1), name="supervisor", daemon=True)
    watcher.start()
    pid = supervisor.pid(stage)
    fault_at = 2.0

    async def load() -> list[tuple[float, str, float]]:
        from recpipe.querygen.clients import connect, get_info
        from recpipe.v1 import recommend_pb2, recommend_pb2_grpc

        channel = await connect(target, 30.0)
        info = await get_info(channel) or {}
        num_users = int(info.get("details", {}).get("num_users", 0) or 1000)
        stub = recommend_pb2_grpc.RecommendServiceStub(channel)
        rng = np.random.default_rng(args.seed)
        rows: list[tuple[float, str, float]] = []  # (sent, from the fault; code; seconds taken)
        import grpc

        async def one(sent: float) -> None:
            request = recommend_pb2.RecommendRequest(user_id=int(rng.integers(num_users)),
                                                     num_candidates=args.num_candidates)
            t = time.perf_counter()
            try:
                await stub.Recommend(request, timeout=args.timeout)
                code = "OK"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            rows.append((sent, code, time.perf_counter() - t))

        start = time.perf_counter()
        gaps = rng.exponential(1.0 / args.rate, size=int(args.rate * args.outage_s * 1.5) + 10)
        tasks, faulted = [], False
        for t in np.cumsum(gaps):
            if t > args.outage_s:
                break
            while (left := start + float(t) - time.perf_counter()) > 0:
                await asyncio.sleep(left)
            if not faulted and t >= fault_at:
                os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                faulted = True
            tasks.append(asyncio.create_task(one(float(t) - fault_at)))
        await asyncio.gather(*tasks)
        await channel.close(None)
        return rows

    try:
        rows = asyncio.run(load())
    finally:
        stop.set()
        watcher.join(timeout=60)
        if how == "freeze":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # if the supervisor did not replace it
    after = sorted((r for r in rows if r[0] >= 0), key=lambda r: r[0])
    last_bad = max((sent for sent, code, _ in after if code != "OK"), default=None)
    back = next((sent for sent, code, _ in after if code == "OK" and last_bad is not None and sent > last_bad), None)
    waited = sum(1 for sent, code, took in after if code == "DEADLINE_EXCEEDED" and took >= 0.9 * args.timeout)
    return {"target": target, "rate": args.rate, "timeout_s": args.timeout, "fault": how, "stage": stage,
            "queries": len(rows), "codes_after_fault": dict(Counter(code for _, code, _ in after)),
            "outage_s": None if last_bad is None else (back if back is not None else float("inf")),
            "waited_out_deadline": waited, "restarted": supervisor.pid(stage) != pid}


def _print_outage(args: argparse.Namespace, r: dict[str, Any]) -> None:
    limit = OUTAGE_S[r["fault"]]
    outage = r["outage_s"]
    shown = "no error at all" if outage is None else f"{outage:.2f} s"
    mark = "ok" if (outage is not None and outage <= limit) or outage is None else "MISS"
    print(f"recpipe bench overload --{r['fault']} {r['stage']}: {args.rate:g} q/s for {args.outage_s:g} s, the stage "
          f"{'killed' if r['fault'] == 'kill' else 'stopped'} 2 s in; deadline {args.timeout * 1e3:.0f} ms")
    print(f"  outage          : {shown} from the signal to the first answer after which all are answered "
          f"(target <= {limit:g} s: {mark}); restarted: {'yes' if r['restarted'] else 'no'}")
    print(f"  after the fault : {r['codes_after_fault']}; {r['waited_out_deadline']} waited out their whole deadline")


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
            if code == "RESOURCE_EXHAUSTED" and not (e.details() or "").startswith(f"{REGISTRY.entry.name}:"):
                code = REFUSED_AFTER_HOPS
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
        return percentile([r[1] * 1e3 for r in rows if r[0] == "OK"], q)

    base_p50, base_p99 = ok_ms(base, 50), ok_ms(base, 99)
    normal_ms = max(2 * base_p50, base_p99)
    # back to normal: from the first probe after which every probe is OK and within the reference p99
    recovered_at = 0.0
    for t, code, lat in probes:
        if code != "OK" or lat * 1e3 > normal_ms:
            recovered_at = t + 0.05
    shed = [r[2] * 1e3 for r in over if r[0] in ("RESOURCE_EXHAUSTED", REFUSED_AFTER_HOPS)]
    codes = Counter(r[0] for r in over)
    seconds = over_end - over_start
    admitted = codes["OK"] + codes["DEADLINE_EXCEEDED"]
    return {
        "target": target, "rate": args.rate, "factor": args.factor, "timeout_s": args.timeout,
        "num_candidates": args.num_candidates, "overload_s": round(over_end - over_start, 2),
        "base": {"queries": len(base), "codes": dict(Counter(r[0] for r in base)), "p50_ms": base_p50,
                 "p99_ms": base_p99},
        "overload": {"queries": len(over), "codes": dict(codes),
                     "goodput_qps": codes["OK"] / seconds if seconds > 0 else float("nan"),
                     "sustained_qps": args.sustained,
                     "refused_at_door": codes["RESOURCE_EXHAUSTED"], "refused_after_hops": codes[REFUSED_AFTER_HOPS],
                     "admitted_expired_share": codes["DEADLINE_EXCEEDED"] / admitted if admitted else None,
                     "accepted_p50_ms": ok_ms(over, 50), "accepted_p99_ms": ok_ms(over, 99),
                     "shed_p50_ms": percentile(shed, 50) if shed else None,
                     "shed_p99_ms": percentile(shed, 99) if shed else None},
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
    goodput = f"    goodput {o['goodput_qps']:.1f} answers/s"
    if o["sustained_qps"]:
        share = o["goodput_qps"] / o["sustained_qps"]
        goodput += (f" = {share:.2f}x the {o['sustained_qps']:g} q/s sustained within the deadline (target >= "
                    f"{GOODPUT_SHARE:g}: {'ok' if share >= GOODPUT_SHARE else 'MISS'})")
    print(goodput)
    expired = o["admitted_expired_share"]
    if expired is not None:
        print(f"    refused at the door {o['refused_at_door']}, after hops {o['refused_after_hops']}; admitted then "
              f"DEADLINE_EXCEEDED {expired:.1%} (target <= {EXPIRED_SHARE:.0%}: "
              f"{'ok' if expired <= EXPIRED_SHARE else 'MISS'})")
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
