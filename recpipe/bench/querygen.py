"""The query generator's own open-loop throughput and send lag against the trivial test server.

The server (recpipe.querygen.testserver, zero delays) runs in a separate process so that the two do
not share a GIL. Each rate is run twice: once on asyncio's default event loop (epoll, whose timeouts
round up to whole milliseconds -- the naive form) and once on the generator's select-based loop, which
wakes within microseconds. Reported: achieved rate, send lag (actual - scheduled send) p50/p99/max,
and the end-to-end p50/p99 seen by the generator.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import statistics
from pathlib import Path
from typing import Any

TARGET_RATE = 2000.0
TARGET_LAG_P99_US = 1000.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="2000", help="comma-separated open-loop rates (queries/s)")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--num-candidates", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per rate and loop, interleaved; the summary takes medians (a shared "
                             "machine's load swings between runs)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")


def _process_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, all threads) of this process or ``pid``; None where unknown."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one(target: str, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    from recpipe.querygen import clients, loops
    from recpipe.querygen.session import achieved_rate
    from recpipe.querygen.workload import QueryStream, UserSpec, fixed_candidates, open_schedule

    channel = await clients.connect(target)
    try:
        queries = QueryStream(UserSpec("uniform", 1000), fixed_candidates(args.num_candidates), args.seed)
        send = clients.gateway_send(channel, queries, 10, 10.0)
        arrivals = open_schedule(rate, args.warmup, args.duration, args.seed)
        rec = await loops.run_open(send, arrivals.tolist(), args.warmup)
    finally:
        await channel.close(None)
    m = rec.finish()
    lag, e2e = m.send_lag.summary(), m.end_to_end.summary()
    return {"rate": rate, "achieved_rate": round(achieved_rate(m, rec.measure_from, args.duration), 1),
            "queries": m.queries, "errors": m.error_count, "lag_p50_us": lag["p50_us"],
            "lag_p99_us": lag["p99_us"], "lag_max_us": lag["max_us"], "e2e_p50_us": e2e["p50_us"],
            "e2e_p99_us": e2e["p99_us"], "warmup_queries": m.warmup_queries}


def _medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(float(r[k]) for r in runs) for k in ("lag_p99_us", "achieved_rate")}


def run(args: argparse.Namespace) -> int:
    from recpipe.errors import UsageError
    from recpipe.querygen import loops
    from recpipe.querygen.testserver import TestServerConfig, TestServerProcess

    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        raise UsageError(f"--rates must be numbers, got {args.rates!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise UsageError("--rates must be positive")
    if args.repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {args.repeat}")
    results = []
    with TestServerProcess(TestServerConfig({})) as server:
        print(f"trivial test server (separate process) at {server.target}; {args.duration:g} s per run "
              f"after {args.warmup:g} s warm-up")
        print(f"{'loop':<22}{'target/s':>10}{'achieved/s':>12}{'lag p50 ms':>12}{'lag p99 ms':>12}"
              f"{'lag max ms':>12}{'e2e p50 ms':>12}{'e2e p99 ms':>12}{'gen us/q':>10}{'srv us/q':>10}")
        for rate, _, (name, factory) in itertools.product(
                rates, range(args.repeat), (("naive (asyncio epoll)", asyncio.new_event_loop),
                                            ("recpipe (select)", loops.new_event_loop))):
            cpu0, srv0 = _process_cpu_s(), _process_cpu_s(server.pid)
            with asyncio.Runner(loop_factory=factory) as runner:
                r = runner.run(_one(server.target, rate, args))
            cpu1, srv1 = _process_cpu_s(), _process_cpu_s(server.pid)
            sent = r["queries"] + r.pop("warmup_queries")
            # CPU per query (all threads, gRPC's included): what bounds the rate on a busy machine.
            r["generator_cpu_us_per_query"] = round((cpu1 - cpu0) / sent * 1e6) if cpu0 and cpu1 else None
            r["server_cpu_us_per_query"] = (round((srv1 - srv0) / sent * 1e6)
                                            if srv0 is not None and srv1 is not None else None)
            r["loop"] = name
            results.append(r)
            print(f"{name:<22}{rate:>10.0f}{r['achieved_rate']:>12.1f}{r['lag_p50_us'] / 1000:>12.3f}"
                  f"{r['lag_p99_us'] / 1000:>12.3f}{r['lag_max_us'] / 1000:>12.3f}"
                  f"{r['e2e_p50_us'] / 1000:>12.3f}{r['e2e_p99_us'] / 1000:>12.3f}"
                  f"{r['generator_cpu_us_per_query'] or 0:>10}{r['server_cpu_us_per_query'] or 0:>10}",
                  flush=True)
        print(f"load average during the runs: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    for rate in rates:
        naive = _medians([r for r in results if r["rate"] == rate and r["loop"].startswith("naive")])
        fast = _medians([r for r in results if r["rate"] == rate and r["loop"].startswith("recpipe")])
        ratio = naive["lag_p99_us"] / max(fast["lag_p99_us"], 1)
        versus = f"{ratio:.1f}x lower" if ratio >= 1 else f"{1 / ratio:.1f}x HIGHER"
        of = f" (median of {args.repeat})" if args.repeat > 1 else ""
        print(f"{rate:.0f} q/s{of}: send lag p99 naive {naive['lag_p99_us'] / 1000:.3f} ms vs recpipe "
              f"{fast['lag_p99_us'] / 1000:.3f} ms ({versus}); achieved {naive['achieved_rate']:.0f} "
              f"vs {fast['achieved_rate']:.0f} q/s")
        if rate >= TARGET_RATE:
            ok = fast["achieved_rate"] >= 0.98 * rate and fast["lag_p99_us"] <= TARGET_LAG_P99_US
            print(f"target (>= {TARGET_RATE:.0f} q/s with send lag p99 <= {TARGET_LAG_P99_US / 1000:g} ms) at "
                  f"{rate:.0f} q/s: {'met' if ok else 'NOT met'}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
