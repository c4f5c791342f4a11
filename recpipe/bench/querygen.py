"""The query generator's own open-loop throughput and send lag against a cheap target.

The target is the test server (recpipe.querygen.testserver) in its fixed-reply form, in a separate
process (the two must not share a GIL): it answers every Recommend with one prepared response, so that
the generator runs out of CPU first. By default it answers at the HTTP/2 frame level
(``--server frames``, recpipe.querygen.frametarget: a fraction of a gRPC server's CPU per query, which
on a small machine is taken from the generator's cores); ``--server aio`` uses the grpc.aio server
with a generic handler, the least a Python gRPC server spends. Each rate is run on asyncio's default
event loop (epoll, whose timeouts round up to whole milliseconds -- the naive form) and on the
generator's select-based loop with each number of sender processes in ``--processes`` (querygen
``--processes``: the schedule dealt among them), side by side in the same run. A rate above what one
process can offer shows the rate each number of processes can: the achieved rate. Reported: achieved
rate, send lag (actual - scheduled send) p50/p99/max, the end-to-end p50/p99 seen by the generator, CPU
per query of the generator (every sender process) and of the target, and the whole machine's CPU per
query and busy share (/proc/stat, all cores): a run that kept the machine busy was limited by the
machine, whatever more sender processes could offer.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import math
import os
import resource
import statistics
from typing import Any

from recpipe import cputime

TARGET_RATE = 2000.0
TARGET_LAG_P99_US = 1000.0
#: done when: where one sender process cannot offer the rate, two offer at least this many times more
TARGET_TWO_PROCESS_GAIN = 1.5
#: a run that achieves less than this share of its rate fell short of it
SHORT_OF_RATE = 0.95
NAIVE = "naive (asyncio epoll)"
SELECT = "recpipe (select)"
FRAMES, AIO = "frames", "aio"
SERVERS = (FRAMES, AIO)
#: the target's address before it is started (only ``run``'s up-front checks see it)
UNSTARTED = "127.0.0.1:0"
_SERVER_NAMES = {FRAMES: "the fixed reply at the HTTP/2 frame level", AIO: "the grpc.aio fixed-reply server"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="2000,25000",
                        help="comma-separated open-loop rates (queries/s); one above what a single process can "
                             "offer (about 12,000 q/s on a 2-core EPYC against the frame-level target, 6,000 "
                             "against aio) shows what each number of processes can (default 2000,25000)")
    parser.add_argument("--processes", default="1,2", metavar="N[,N...]",
                        help="sender process counts to run side by side on the select loop (default 1,2)")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--num-candidates", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds per rate, in alternating order; the summary takes medians (a shared "
                             "machine's load swings between runs)")
    parser.add_argument("--server", choices=SERVERS, default=FRAMES,
                        help="the target: the fixed reply at the HTTP/2 frame level (frames, the default: "
                             "the least CPU per query) or from a grpc.aio server (aio)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")


def _process_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, all threads) of this process or ``pid``; None where unknown."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    return cputime.cpu_seconds(pid)


def _row(rate: float, m: Any, achieved: float) -> dict[str, Any]:
    lag, e2e = m.send_lag.summary(), m.end_to_end.summary()
    return {"rate": rate, "achieved_rate": round(achieved, 1), "queries": m.queries, "errors": m.error_count,
            "lag_p50_us": lag["p50_us"], "lag_p99_us": lag["p99_us"], "lag_max_us": lag["max_us"],
            "e2e_p50_us": e2e["p50_us"], "e2e_p99_us": e2e["p99_us"], "warmup_queries": m.warmup_queries}


async def _naive(target: str, rate: float, args: argparse.Namespace) -> tuple[dict[str, Any], float]:
    """One process, the loop handed in by the caller (asyncio's default): the naive form."""
    from recpipe.querygen import clients, loops
    from recpipe.querygen.session import achieved_rate
    from recpipe.querygen.workload import QueryStream, UserSpec, fixed_candidates, open_schedule

    channel = await clients.connect(target)
    try:
        queries = QueryStream(UserSpec("uniform", 1000), fixed_candidates(args.num_candidates), args.seed)
        send = clients.gateway_send(channel, queries, 10, 10.0)
        arrivals = open_schedule(rate, args.warmup, args.duration, args.seed)
        cpu0 = _process_cpu_s() or 0.0
        rec = await loops.run_open(send, arrivals.tolist(), args.warmup)
        cpu = (_process_cpu_s() or 0.0) - cpu0
    finally:
        await channel.close(None)
    m = rec.finish()
    return _row(rate, m, achieved_rate(m, rec.measure_from, args.duration)), cpu


async def _senders(target: str, rate: float, processes: int, args: argparse.Namespace
                   ) -> tuple[dict[str, Any], float]:
    """querygen's own path (a Session, ``--processes N``): the run and the generator's CPU seconds, its
    sender processes' included."""
    from recpipe.querygen.session import Session

    session = Session(_config(target, rate, processes, args), stream=io.StringIO())
    await session.open()
    try:
        cpu0 = _process_cpu_s() or 0.0
        step = await session.measure(rate)
        cpu = (_process_cpu_s() or 0.0) - cpu0 + step.sender_cpu_s
    finally:
        await session.close()
    row = _row(rate, step.measurement, step.achieved)
    row["process_lag_p99_us"] = [r.measurement.send_lag.percentile_us(99) for r in step.senders]
    return row, cpu


def _config(target: str, rate: float, processes: int, args: argparse.Namespace) -> Any:
    """The querygen configuration of one run (which validates it: ``run`` builds each before starting)."""
    from recpipe.querygen.config import QuerygenConfig
    from recpipe.querygen.workload import fixed_candidates

    return QuerygenConfig(target=target, mode="open", candidates=fixed_candidates(args.num_candidates),
                          rate=rate, duration=args.duration, warmup=args.warmup, num_users=1000,
                          seed=args.seed, processes=processes,
                          # the fixed reply ignores it; querygen refuses more results than candidates
                          num_results=min(10, args.num_candidates))


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}"


def _machine_line(by_n: dict[int, dict[str, float]]) -> str:
    """How busy the whole machine was in each number of processes' runs (medians), and what limited them:
    ``"the whole machine (all cores, /proc/stat): 1 process 52% busy (the generator was the limit), 2
    processes 99% busy (the machine was the limit: 690 us of its CPU per query, 168 of them outside
    generator and target)"``."""
    parts = []
    for n, m in by_n.items():
        busy = m.get("machine_busy")
        if busy is None:
            continue
        part = f"{n} process{'es' if n > 1 else ''} {_percent(busy)}% busy"
        if busy < cputime.SATURATED:
            parts.append(part + " (the generator was the limit)")
            continue
        part += " (the machine was the limit"
        per_query = m.get("machine_cpu_us_per_query")
        if per_query:
            outside = per_query - m.get("generator_cpu_us_per_query", 0.0) - m.get("server_cpu_us_per_query", 0.0)
            part += f": {per_query:.0f} us of its CPU per query, {max(0.0, outside):.0f} of them outside generator and target"
        parts.append(part + ")")
    return "the whole machine (all cores, /proc/stat): " + (", ".join(parts) if parts else "not readable here")


def _medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The runs' medians of each measure that all of them have (the machine's is None where /proc/stat
    is not readable)."""
    keys = ("lag_p99_us", "achieved_rate", "generator_cpu_us_per_query", "server_cpu_us_per_query", "machine_busy",
            "machine_cpu_us_per_query")
    return {k: statistics.median(float(r[k]) for r in runs) for k in keys if all(r.get(k) is not None for r in runs)}


def _parse_list(text: str, flag: str, kind: type) -> list[Any]:
    from recpipe.errors import UsageError

    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} must be numbers, got {text!r}") from None
    if not values or not all(v > 0 and math.isfinite(v) for v in values):
        raise UsageError(f"{flag} must be positive (and finite), got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    from recpipe.errors import UsageError
    from recpipe.querygen import loops
    from recpipe.querygen.config import parse_processes
    from recpipe.querygen.testserver import TestServerConfig, TestServerProcess

    rates = _parse_list(args.rates, "--rates", float)
    parsed = [parse_processes(p, "--processes") for p in args.processes.split(",") if p.strip()]
    counts = [n for n in parsed if isinstance(n, int)]
    if not counts or len(counts) != len(parsed):
        raise UsageError(f"--processes takes process counts such as 1,2 (not auto), got {args.processes!r}")
    if args.repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {args.repeat}")
    for rate in rates:  # every run's settings refused here, before the target starts or the header prints
        _config(UNSTARTED, rate, max(counts), args)
    variants = [(NAIVE, 1), *((SELECT, n) for n in counts)]
    results = []
    with TestServerProcess(TestServerConfig({}, fixed_reply=True, frames=args.server == FRAMES)) as server:
        print(f"cheap target: {_SERVER_NAMES[args.server]} (separate process) at {server.target}; "
              f"{args.duration:g} s per run after {args.warmup:g} s warm-up; {os.cpu_count()} cores")
        print(f"{'loop':<22}{'procs':>6}{'target/s':>10}{'achieved/s':>12}{'lag p50 ms':>12}{'lag p99 ms':>12}"
              f"{'lag max ms':>12}{'e2e p50 ms':>12}{'e2e p99 ms':>12}{'gen us/q':>10}{'srv us/q':>10}"
              f"{'all us/q':>10}{'busy %':>8}")
        for rate, round_ in itertools.product(rates, range(args.repeat)):
            # alternate the order between rounds, so a drift in the machine's load favours no variant
            for name, n in variants if round_ % 2 == 0 else variants[::-1]:
                srv0, machine0 = _process_cpu_s(server.pid), cputime.machine_ticks()
                if name == NAIVE:
                    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
                        r, gen_cpu = runner.run(_naive(server.target, rate, args))
                else:
                    r, gen_cpu = loops.run(_senders(server.target, rate, n, args))
                srv1, machine1 = _process_cpu_s(server.pid), cputime.machine_ticks()
                sent = r["queries"] + r.pop("warmup_queries")
                # CPU per query (all threads, gRPC's included): what bounds the rate on a busy machine.
                r["generator_cpu_us_per_query"] = round(gen_cpu / sent * 1e6) if sent else None
                r["server_cpu_us_per_query"] = (round((srv1 - srv0) / sent * 1e6)
                                                if srv0 is not None and srv1 is not None and sent else None)
                # The whole machine's: what generator and target leave to the rest (the kernel's loopback
                # work outside any process, other jobs). A share near 1 means the machine is the limit.
                share = machine0.busy_share(machine1) if machine0 and machine1 else None
                r["machine_busy"] = round(share, 3) if share is not None else None
                r["machine_cpu_us_per_query"] = (round(machine0.busy_seconds(machine1) / sent * 1e6)
                                                 if machine0 and machine1 and sent else None)
                r["loop"], r["processes"], r["round"] = name, n, round_ + 1
                results.append(r)
                print(f"{name:<22}{n:>6}{rate:>10.0f}{r['achieved_rate']:>12.1f}{r['lag_p50_us'] / 1000:>12.3f}"
                      f"{r['lag_p99_us'] / 1000:>12.3f}{r['lag_max_us'] / 1000:>12.3f}"
                      f"{r['e2e_p50_us'] / 1000:>12.3f}{r['e2e_p99_us'] / 1000:>12.3f}"
                      f"{r['generator_cpu_us_per_query'] or 0:>10}{r['server_cpu_us_per_query'] or 0:>10}"
                      f"{r['machine_cpu_us_per_query'] or 0:>10}{_percent(r['machine_busy']):>8}", flush=True)
        print(f"load average during the runs: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    of = f" (median of {args.repeat})" if args.repeat > 1 else ""
    for rate in rates:
        naive = _medians([r for r in results if r["rate"] == rate and r["loop"] == NAIVE])
        by_n = {n: _medians([r for r in results if r["rate"] == rate and r["loop"] == SELECT and r["processes"] == n])
                for n in counts}
        if 1 in by_n:
            fast = by_n[1]
            ratio = naive["lag_p99_us"] / max(fast["lag_p99_us"], 1)
            versus = f"{ratio:.1f}x lower" if ratio >= 1 else f"{1 / ratio:.1f}x HIGHER"
            print(f"{rate:.0f} q/s{of}: send lag p99 naive {naive['lag_p99_us'] / 1000:.3f} ms vs recpipe "
                  f"{fast['lag_p99_us'] / 1000:.3f} ms ({versus}); achieved {naive['achieved_rate']:.0f} "
                  f"vs {fast['achieved_rate']:.0f} q/s")
            # a rate one process falls short of is the sender processes' line below, not this target's
            if rate >= TARGET_RATE and fast["achieved_rate"] >= SHORT_OF_RATE * rate:
                ok = fast["achieved_rate"] >= 0.98 * rate and fast["lag_p99_us"] <= TARGET_LAG_P99_US
                print(f"target (>= {TARGET_RATE:.0f} q/s with send lag p99 <= {TARGET_LAG_P99_US / 1000:g} ms) at "
                      f"{rate:.0f} q/s: {'met' if ok else 'NOT met'}")
        one = by_n.get(1, {}).get("achieved_rate")
        print(f"{rate:.0f} q/s{of}: sender processes -> achieved " + ", ".join(
            f"{n}: {m['achieved_rate']:.0f} q/s" + (f" ({m['achieved_rate'] / one:.2f}x)" if one and n != 1 else "")
            for n, m in by_n.items()))
        if one and 2 in by_n and one < SHORT_OF_RATE * rate:
            gain = by_n[2]["achieved_rate"] / one
            print(f"target (one process falls short of {rate:.0f} q/s: two offer >= {TARGET_TWO_PROCESS_GAIN:g}x "
                  f"its rate): {gain:.2f}x, {'met' if gain >= TARGET_TWO_PROCESS_GAIN else 'NOT met'}")
            # Where the machine, not the generator, is the limit: the target's CPU counts against the
            # same cores, so n senders can offer at most cores / (generator + target CPU per query).
            two = [r for r in results if r["rate"] == rate and r["loop"] == SELECT and r["processes"] == 2]
            gen = statistics.median(float(r["generator_cpu_us_per_query"] or 0) for r in two)
            srv = statistics.median(float(r["server_cpu_us_per_query"] or 0) for r in two)
            from recpipe.serving.threads import usable_cores

            cores = usable_cores()
            if gen + srv > 0:
                print(f"  the machine's bound: {cores} cores / ({gen:.0f} generator + {srv:.0f} target us of CPU "
                      f"per query) = {cores / (gen + srv) * 1e6:.0f} q/s, {cores / (gen + srv) * 1e6 / one:.2f}x "
                      "one process's rate, before anything else on the machine takes its share")
            print("  " + _machine_line(by_n))
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
