"""The gRPC chain against the same cores chained in process (no gRPC), sequential queries, one run.

Starts the four stages as their own processes (or uses --target), loads the same cores into this
process, and sends the same user ids through both, alternating query by query so both see the same
machine noise. Prints p50/p99 per stage (server time, and gateway-observed time for gRPC) and end to end
(client-observed for gRPC, the chain call for in-process) and the gRPC/in-process ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from recpipe.bench._args import at_least, check_out, require_dirs, within
from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_MODELS_DIR, MAX_NUM_CANDIDATES, STEPS, TOTAL_STEP
from recpipe.files import write_atomic

T = TypeVar("T")
#: The ratio the issue asks for: gRPC end to end p50 <= 1.3 x in-process.
TARGET_RATIO = 1.3
#: The issue's server-time p50 targets at full scale on CPU, num_candidates 500 (ms), and end to end.
TARGET_P50_MS = {"augment_user": 0.5, "retrieve": 3.0, "augment_items": 2.0, "rank": 10.0}
TARGET_E2E_P50_MS = 20.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR))
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--num-candidates", type=int, default=500)
    parser.add_argument("--num-results", type=int, default=10)
    parser.add_argument("--device", default="cpu", help="retrieval and ranking device (auto|cpu|cuda)")
    parser.add_argument("--threads", type=int, default=0, help="compute threads per stage (0 = library default)")
    parser.add_argument("--workers", type=int, default=0, help="stage core threads (0 = on the event loop when predicted short)")
    parser.add_argument("--target", default=None, help="measure this running gateway instead of starting one (its "
                        "answers equal the in-process chain's when it ranks in fp32: --ranking-precision fp32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the in-process chain) without an event loop's overhead."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("the in-process chain suspended; it must not")


def run(args: argparse.Namespace) -> int:
    at_least(1, ("--queries", args.queries))
    at_least(0, ("--warmup", args.warmup), ("--threads", args.threads), ("--workers", args.workers),
             ("--seed", args.seed))
    within(1, MAX_NUM_CANDIDATES, ("--num-candidates", args.num_candidates))
    within(1, args.num_candidates, ("--num-results", args.num_results))
    require_dirs(("--models", args.models), ("--data", args.data))
    check_out("--out", args.out, args.force)  # before the run, not after it
    import numpy as np

    from recpipe.client import RecommendClient
    from recpipe.config import DEFAULT_HOST
    from recpipe.gateway.latency import stage_summaries
    from recpipe.inprocess import IN_PROCESS_OPTIONS
    from recpipe.percentiles import Summary
    from recpipe.serving import threads
    from recpipe.serving.launch import allocate_ports, supervised_stages
    from recpipe.serving.options import merged_argv
    from recpipe.serving.supervisor import Supervisor
    from recpipe.stages import REGISTRY
    from recpipe.types import Recommendation

    supervisor = None
    target = args.target
    if target is None:
        ports = allocate_ports(REGISTRY, DEFAULT_HOST, 0, -1)
        stages = supervised_stages(REGISTRY, models=args.models, data=args.data, host=DEFAULT_HOST, ports=ports,
                                   device=args.device, threads=args.threads,
                                   workers=args.workers,
                                   # the in-process chain's options (fp32 ranking), so both answer alike
                                   extra=[*merged_argv(IN_PROCESS_OPTIONS.values()),
                                          *(["--nvtx"] if getattr(args, "nvtx", False) else [])])
        supervisor = Supervisor(stages)
        supervisor.launch()  # the stages load while this process loads its own cores
        target = supervisor.addresses()[REGISTRY.entry.name]
    try:
        threads.configure(args.threads, torch=True, faiss=True)
        from recpipe.inprocess import LocalFeatureClient, local_chain

        local = local_chain(args.models, args.data, device=args.device)
        assert isinstance(local.features, LocalFeatureClient)
        num_users = local.features.core.num_users
        if supervisor is not None:
            supervisor.wait_serving(timeout_s=600, during_startup=True)
        rng = np.random.default_rng(args.seed)
        users = rng.integers(0, num_users, size=args.warmup + args.queries).tolist()
        k, n = args.num_candidates, args.num_results
        grpc_recs: list[Recommendation] = []
        local_recs: list[Recommendation] = []
        grpc_us: list[int] = []
        local_us: list[int] = []
        disagree = 0
        with RecommendClient(target) as client:
            for i, user in enumerate(users):
                t0 = time.perf_counter_ns()
                g = client.recommend(user, k, n)
                t1 = time.perf_counter_ns()
                loc = run_now(local.recommend(user, k, n))
                t2 = time.perf_counter_ns()
                if i < args.warmup:
                    continue
                disagree += g.item_ids.tolist() != loc.item_ids.tolist()
                grpc_recs.append(g)
                local_recs.append(loc)
                grpc_us.append((t1 - t0) // 1000)
                local_us.append((t2 - t1) // 1000)
    finally:
        if supervisor is not None:
            supervisor.stop()

    g_stages, l_stages = stage_summaries(grpc_recs), stage_summaries(local_recs)
    g_e2e, l_e2e = Summary.of(grpc_us), Summary.of(local_us)
    print(f"recpipe bench chain: {args.queries} sequential queries (+{args.warmup} warm-up), num_candidates {k}, "
          f"num_results {n}, device {args.device}, threads {args.threads or 'default'}, workers {args.workers}")
    print(f"{'':<16}{'gRPC server':>22}{'gRPC observed':>22}{'in-process':>22}")
    print(f"{'stage (ms)':<16}" + f"{'p50':>11}{'p99':>11}" * 3 + f"{'target p50':>12}")
    rows = []
    for stage in STEPS:
        gs, go = g_stages[stage]
        ls, _ = l_stages[stage]
        mark = "ok" if gs.p50 / 1000 <= TARGET_P50_MS[stage] else "MISS"
        print(f"{stage:<16}" + "".join(f"{v / 1000:>11.3f}" for v in (gs.p50, gs.p99, go.p50, go.p99, ls.p50, ls.p99))
              + f"{'<= ' + str(TARGET_P50_MS[stage]):>9} {mark}")
        rows.append({"stage": stage, "grpc_server_p50_us": gs.p50, "grpc_server_p99_us": gs.p99,
                     "grpc_observed_p50_us": go.p50, "grpc_observed_p99_us": go.p99,
                     "inprocess_p50_us": ls.p50, "inprocess_p99_us": ls.p99})
    gw_srv, _ = g_stages[TOTAL_STEP]
    print(f"{'gateway total':<16}" + "".join(f"{v / 1000:>11.3f}" for v in (gw_srv.p50, gw_srv.p99)))
    mark = "ok" if g_e2e.p50 / 1000 <= TARGET_E2E_P50_MS else "MISS"
    print(f"{'end to end':<16}{'':>22}" + "".join(f"{v / 1000:>11.3f}" for v in (g_e2e.p50, g_e2e.p99, l_e2e.p50, l_e2e.p99))
          + f"{'<= ' + str(TARGET_E2E_P50_MS):>9} {mark}")
    ratio = g_e2e.p50 / l_e2e.p50
    verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
    print(f"end to end p50: gRPC {g_e2e.p50 / 1000:.3f} ms vs in-process {l_e2e.p50 / 1000:.3f} ms = {ratio:.2f}x "
          f"({verdict} the {TARGET_RATIO}x target); p99 ratio {g_e2e.p99 / l_e2e.p99:.2f}x")
    overhead = attribute_overhead(grpc_recs, grpc_us, local_us)
    print("where gRPC's extra time goes (p50 per query, ms): " + ", ".join(
        f"{name} {value / 1000:.3f}" for name, value in overhead.items()))
    print(f"answers that differ between the two chains: {disagree} of {len(grpc_recs)}")
    if args.out is not None:
        report = {"queries": args.queries, "num_candidates": k, "num_results": n, "device": args.device,
                  "threads": args.threads, "workers": args.workers, "stages": rows, "disagreements": disagree, "overhead_p50_us": overhead,
                  "end_to_end": {"grpc_p50_us": g_e2e.p50, "grpc_p99_us": g_e2e.p99,
                                 "inprocess_p50_us": l_e2e.p50, "inprocess_p99_us": l_e2e.p99, "ratio_p50": ratio}}
        write_atomic(args.out, json.dumps(report, indent=2) + "\n", force=args.force)
    return 0


def attribute_overhead(recs: list[Any], client_us: list[int], local_us: list[int]) -> dict[str, float]:
    """Medians over queries of: the four stage hops (observed - server), the gateway's own work
    (its total - the hops it observed), the client -> gateway hop (client - gateway total), and the
    paired difference gRPC - in-process end to end."""
    import numpy as np

    hops, gateway, front = [], [], []
    for rec, c in zip(recs, client_us, strict=True):
        observed = sum(rec.timing(s).observed_us for s in STEPS)
        hops.append(observed - sum(rec.timing(s).server_us for s in STEPS))
        total = rec.timing(TOTAL_STEP).server_us
        gateway.append(total - observed)
        front.append(c - total)
    paired = np.asarray(client_us) - np.asarray(local_us)
    return {
        "stage hops": float(np.median(hops)),
        "gateway work": float(np.median(gateway)),
        "client hop": float(np.median(front)),
        "gRPC - in-process": float(np.median(paired)),
    }
