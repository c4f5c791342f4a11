"""Ask the gateway for recommendations and print per-stage timings."""

from __future__ import annotations

import argparse
import math
import time

from recpipe.config import DEFAULT_HOST, DEFAULT_PORT, STEPS, TOTAL_STEP
from recpipe.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--user-id", type=int, required=True)
    parser.add_argument("--num-candidates", type=int, default=0, help="candidates to retrieve (0 = 500)")
    parser.add_argument("--num-results", type=int, default=0, help="items to return (0 = 10)")
    parser.add_argument("--target", default=f"{DEFAULT_HOST}:{DEFAULT_PORT}",
                        help=f"gateway host:port (default {DEFAULT_HOST}:{DEFAULT_PORT})")
    parser.add_argument("--timeout", type=float, default=10.0, help="deadline in seconds (default 10)")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.timeout < math.inf:
        raise UsageError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    for flag, value, bits in (("--user-id", args.user_id, 64), ("--num-candidates", args.num_candidates, 32),
                              ("--num-results", args.num_results, 32)):
        if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):  # the request's field; the gateway checks the rest
            raise UsageError(f"{flag} {value} does not fit the request's int{bits} field")
    from recpipe.client import RecommendClient

    with RecommendClient(args.target, timeout=args.timeout) as client:
        # nothing listening there (a wrong --target, no `recpipe serve`): the user's mistake, exit 2 with
        # one line, as querygen's; a gateway that answers UNAVAILABLE (a stage down) stays a failure (1)
        why = client.connect()
        if why is not None:
            raise UsageError(f"cannot reach the gateway at {client.target}: {why}; is `recpipe serve` running there?")
        start = time.perf_counter_ns()
        rec = client.recommend(args.user_id, args.num_candidates, args.num_results)
        client_us = (time.perf_counter_ns() - start) // 1000
    print(f"user {args.user_id}: {len(rec.item_ids)} items  (model {rec.model_version or '?'}, gateway {args.target})")
    print(f"{'#':>4}  {'item_id':>10}  {'score':>8}")
    for i, (item, score) in enumerate(zip(rec.item_ids.tolist(), rec.scores.tolist(), strict=True), 1):
        print(f"{i:>4}  {item:>10}  {score:>8.4f}")
    print()
    split = any(int(getattr(t, "batch_size", 0)) for t in rec.timings)
    extra = f"{'queue ms':>10}{'compute ms':>12}{'batch':>7}" if split else ""
    print(f"{'stage':<14}{'server ms':>11}{'observed ms':>13}{extra}")
    for stage in (*STEPS, TOTAL_STEP):
        try:
            t = rec.timing(stage)
        except KeyError:
            continue
        row = f"{stage:<14}{t.server_us / 1000:>11.3f}{t.observed_us / 1000:>13.3f}"
        batch = int(getattr(t, "batch_size", 0))
        if split and batch:
            row += (f"{int(getattr(t, 'queue_us', 0)) / 1000:>10.3f}"
                    f"{int(getattr(t, 'compute_us', 0)) / 1000:>12.3f}{batch:>7d}")
        print(row)
    print(f"{'client':<14}{'':>11}{client_us / 1000:>13.3f}")
    return 0
