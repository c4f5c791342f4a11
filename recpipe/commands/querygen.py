"""Generate queries and measure per-stage latency (sequential, open or closed loop).

Open loop sends at Poisson arrival times from a seeded schedule and charges latency from the scheduled
send time, so a slow server (or a generator that falls behind) cannot hide its tail. With
--slo-p99-ms it searches the highest rate whose end-to-end p99 meets the bound. One run (each SLO step,
each stability window) plans at most 10,000,000 queries: their arrival times and answers are held in
memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recpipe.config import DEFAULT_NUM_CANDIDATES, DEFAULT_NUM_RESULTS, normalize_target
from recpipe.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", metavar="HOST:PORT", help="the gateway (RecommendService); :PORT means "
                        "127.0.0.1:PORT, here and in --features/--retrieval/--ranking")
    # Not `choices=`: an unknown mode gets the same one-line message as every other bad value.
    parser.add_argument("--mode", default="sequential", help="sequential | open | closed (default sequential)")
    parser.add_argument("--rate", type=float, help="open loop: target queries/s (Poisson arrivals)")
    parser.add_argument("--concurrency", type=int, default=1, help="closed loop: number of clients")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--duration", type=float, metavar="S", help="measured seconds (default 10; "
                        "per step with --slo-p99-ms, default 5)")
    length.add_argument("--queries", type=int, metavar="N", help="measured queries (open: duration N/rate)")
    parser.add_argument("--min-queries", type=int, default=0, metavar="N",
                        help="open loop: run each measurement (each SLO step) until N queries were sent if its "
                             "--duration holds fewer, as MLPerf LoadGen's minimum query count does: a p99 from "
                             "1000 queries rests on 10 beyond it (default 0: --duration alone)")
    parser.add_argument("--warmup", type=float, default=0.0, metavar="S",
                        help="seconds of load before measuring, excluded from the statistics (default 0)")
    parser.add_argument("--users", default="uniform", help="uniform | zipf (user-id popularity)")
    parser.add_argument("--zipf-exponent", type=float, default=1.0)
    parser.add_argument("--num-users", type=int, help="user ids 0..N-1 (default: GetInfo details['num_users'] of "
                        "the gateway or the features stage, else 1000)")
    cands = parser.add_mutually_exclusive_group()
    cands.add_argument("--num-candidates", type=int, help=f"candidates per query (default {DEFAULT_NUM_CANDIDATES})")
    cands.add_argument("--candidates-dist", metavar="lognormal:MEDIAN,SIGMA")
    cands.add_argument("--candidates-file", metavar="QUANTILES",
                       help="quantile file: lines 'QUANTILE VALUE' (quantile in [0,1]) or one VALUE per "
                            "line (equally spaced quantiles); '#' comments; sampled by inverse CDF")
    parser.add_argument("--num-results", type=int, default=DEFAULT_NUM_RESULTS,
                        help=f"results per query (default {DEFAULT_NUM_RESULTS}); at most the candidates a query "
                             "asks for, which the gateway requires (refused if over 1%% of queries would ask "
                             "for fewer)")
    parser.add_argument("--slo-p99-ms", type=float, metavar="X",
                        help="open loop: find the highest rate with end-to-end p99 <= X ms (starts at --rate)")
    parser.add_argument("--arrivals-file", metavar="F", help="--mode open: replay these inter-arrival times (one "
                        "per line, in microseconds, like perf_analyzer's --request-intervals; '#' comments), "
                        "cycling through the file; sets the rate")
    parser.add_argument("--stability-percent", type=float, metavar="P",
                        help="repeat measurement windows (each --duration/--queries long) until the last 3 "
                             "agree within P%% on --stability-percentile (perf_analyzer -s); reports the windows")
    parser.add_argument("--stability-percentile", type=float, default=99.0, metavar="X",
                        help="end-to-end percentile the windows must agree on (default 99)")
    parser.add_argument("--max-windows", type=int, default=10, metavar="N",
                        help="--stability-percent: give up after N windows (default 10)")
    parser.add_argument("--processes", default="1", metavar="N|auto",
                        help="sender processes (default 1): open loop deals the one seeded schedule among them, "
                             "closed loop divides the clients; one merged report with each process's send "
                             "lag. auto: sized from the offered rate (closed loop: the clients), at most the "
                             "usable cores. Sequential runs in one process")
    parser.add_argument("--seed", type=int, default=0, help="seeds the schedule and the queries (>= 0)")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="S", help="per-query deadline (default 10)")
    parser.add_argument("--per-component", action="store_true",
                        help="call features, retrieval and ranking directly, timing each from the client: give "
                             "each stage's own address (recpipe's gateway serves none of their services, so "
                             "--target alone fits only a server that serves all three on one port, such as "
                             "the test server, recpipe.querygen.testserver)")
    parser.add_argument("--features", metavar="HOST:PORT", help="--per-component: the features stage (default "
                        "--target)")
    parser.add_argument("--retrieval", metavar="HOST:PORT", help="--per-component: the retrieval stage "
                        "(default --target)")
    parser.add_argument("--ranking", metavar="HOST:PORT", help="--per-component: the ranking stage (default "
                        "--target)")
    parser.add_argument("--out", metavar="RUN.json", help="write the run document here")
    parser.add_argument("--plot", metavar="DIR", help="write PNG charts into DIR (created if missing)")
    parser.add_argument("--force", action="store_true", help="overwrite --out / --plot files")
    parser.add_argument("--quiet", action="store_true", help="no summary table on stdout")


def build_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from recpipe.querygen.config import QuerygenConfig, parse_processes
    from recpipe.querygen.workload import (
        fixed_candidates,
        load_arrivals_file,
        load_quantile_file,
        parse_lognormal,
    )

    if args.candidates_dist is not None:
        candidates = parse_lognormal(args.candidates_dist)
    elif args.candidates_file is not None:
        candidates = load_quantile_file(args.candidates_file)
    else:
        candidates = fixed_candidates(DEFAULT_NUM_CANDIDATES if args.num_candidates is None
                                      else args.num_candidates)
    def target(value: str | None) -> str | None:
        return normalize_target(value) if value else value

    return QuerygenConfig(
        target=target(args.target), mode=args.mode, candidates=candidates, rate=args.rate,
        concurrency=args.concurrency, duration=args.duration, queries=args.queries, warmup=args.warmup,
        users=args.users, zipf_exponent=args.zipf_exponent, num_users=args.num_users,
        num_results=args.num_results, slo_p99_ms=args.slo_p99_ms, seed=args.seed, timeout=args.timeout,
        per_component=args.per_component, features=target(args.features), retrieval=target(args.retrieval),
        ranking=target(args.ranking),
        arrivals=load_arrivals_file(args.arrivals_file) if args.arrivals_file else None,
        stability_percent=args.stability_percent, stability_percentile=args.stability_percentile,
        max_windows=args.max_windows, processes=parse_processes(args.processes), min_queries=args.min_queries)


def run(args: argparse.Namespace) -> int:
    import contextlib

    from recpipe.files import check_writable, output_dir, write_files
    from recpipe.querygen import loops, output, plots, session
    config = build_config(args)
    # Every output is refused here, before a query is sent, not after the run: --out, and --plot's
    # directory (created now; removed again if the run fails) and each chart in it.
    if args.out:
        check_writable(args.out, args.force)
    with output_dir(args.plot, "--plot") if args.plot else contextlib.nullcontext() as plot_dir:
        if plot_dir is not None:
            existing = sorted(plot_dir.glob("*.png"))
            if existing and not args.force:
                raise UsageError(f"{args.plot} already holds charts ({existing[0].name}); pass --force")
            for name in plots.run_chart_names(None):
                check_writable(plot_dir / name, True)
        doc = loops.run(session.execute(config))
        for w in doc["warnings"]:
            print(f"recpipe querygen: warning: {w}", file=sys.stderr)
        if not args.quiet:
            print(output.summary_text(doc))
        # the run document and its charts appear together or not at all
        files: dict[Path, bytes | str] = {Path(args.out): output.document_text(doc)} if args.out else {}
        if plot_dir is not None:
            files.update(plots.run_plots(doc, plot_dir))
        write_files(files, args.force)
    if doc["queries"] and not doc["ok"]:
        hint = ""
        if config.per_component and "UNIMPLEMENTED" in doc["errors_by_code"]:
            hint = ("; an address does not serve its stage's service: --per-component needs each stage's "
                    "own address (--features, --retrieval, --ranking), not the gateway's")
        elif "UNAVAILABLE" in doc["errors_by_code"]:
            hint = ("; UNAVAILABLE: a stage is down or still loading (`recpipe serve` prints its table once "
                    "every stage is SERVING)")
        print(f"recpipe querygen: no query succeeded ({doc['errors_by_code']}){hint}", file=sys.stderr)
        return 1
    return 0
