"""First calls on a fresh chain: each candidate count's first Recommend against its second, per ranking precision.

For each ranking precision (``--precisions``; default every form this CPU offers: fp32, int8, and
bf16 compiled where the CPU has native bf16), ``recpipe serve`` starts the whole chain as a user would
(one process per stage under the supervisor, ``--ranking-precision FORM``), its output going to
``DIR/serve-FORM.log``. Once the gateway is SERVING and the chain's processes are idle (the warm
standbys that start behind it have loaded: on 2 cores their imports and compilation would otherwise
run beside the first calls), the chain gets two Recommend calls for each count of
``--counts`` in turn (1, 2, 3, 17, 500, 10,000 by default): no query has reached it before, so each
count's first call is the first the stages see of that size. The table gives the end-to-end time and
each stage's server time of the first and the second call and their ratio, then the restarts and
health kills the serve log records. A compile or a capture on the request path shows up as a first call
many times its second (and, when it stalls the stage, as a restart).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from recpipe.bench._args import above, check_out, require_dirs, within
from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_HOST, DEFAULT_MODELS_DIR, MAX_NUM_CANDIDATES
from recpipe.errors import RecpipeError, UsageError
from recpipe.serving.launch import threads_arg

COUNTS = (1, 2, 3, 17, 500, 10_000)
#: what the serve log says when the supervisor restarts or kills a stage
RESTART_MARKS = ("restarting", "restarted", "killing it")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR))
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--precisions", default="", help="ranking precisions, comma-separated (default: every form "
                                                          "this CPU offers)")
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)),
                        help="candidate counts, in the order they are sent (default %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the serve logs and firstcall.json")
    parser.add_argument("--threads", default="auto", help="serve --threads (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the chain may take to start")
    parser.add_argument("--force", action="store_true", help="replace the results of an earlier run in --out")


def run(args: argparse.Namespace) -> int:
    require_dirs(("--models", args.models), ("--data", args.data))
    try:
        counts = [int(c) for c in args.counts.split(",") if c.strip()]
    except ValueError:
        raise UsageError(f"--counts must be integers, comma-separated, got {args.counts!r}") from None
    if not counts:
        raise UsageError("--counts must name at least one count")
    within(1, MAX_NUM_CANDIDATES, *(("--counts", c) for c in counts))
    above(0, ("--timeout", args.timeout))
    try:
        threads_arg(args.threads)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"--threads {e}") from None
    from recpipe.ranking import precision as precisions

    if args.precisions:
        forms = [f.strip() for f in args.precisions.split(",") if f.strip()]
        if not forms or any(f not in precisions.PRECISIONS for f in forms):
            raise UsageError(f"--precisions takes forms of {'|'.join(precisions.PRECISIONS)}, comma-separated, "
                             f"got {args.precisions!r}")
    else:
        import torch

        forms = list(precisions.available(torch.device("cpu")))
    from recpipe.files import write_atomic

    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} is not a directory")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot create it ({e.strerror})") from None
    results_file = args.out / "firstcall.json"
    for path in (results_file, *(args.out / f"serve-{form}.log" for form in forms)):  # before minutes of work
        check_out("--out", path, args.force)
    results = [_one_chain(args, form, counts) for form in forms]
    _print(results)
    write_atomic(results_file, json.dumps(results, indent=2) + "\n", force=args.force)
    return 0


def _one_chain(args: argparse.Namespace, form: str, counts: list[int]) -> dict[str, Any]:
    from recpipe.client import RecommendClient
    from recpipe.ranking import NAME as RANKING
    from recpipe.serving.healthcheck import check
    from recpipe.serving.supervisor import free_port
    from recpipe.stages import REGISTRY

    port = _free_block(free_port)
    log_path = args.out / f"serve-{form}.log"
    argv = [sys.executable, "-m", "recpipe", "serve", "--models", str(args.models), "--data", str(args.data),
            "--port", str(port), "--metrics-port", "-1", "--threads", str(args.threads), "--ranking-precision", form]
    target = f"{DEFAULT_HOST}:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    try:
        while not check(target, timeout=1.0)[0]:
            if proc.poll() is not None:
                raise UsageError(f"recpipe serve exited with code {proc.returncode} (see {log_path})")
            if time.monotonic() - t0 > args.timeout:
                raise UsageError(f"the chain was not SERVING after {args.timeout:g} s (see {log_path})")
            time.sleep(0.2)
        serving_s = time.monotonic() - t0
        quiet_s = _wait_quiet(proc.pid, args.timeout) - t0
        rows = []
        with RecommendClient(f"{DEFAULT_HOST}:{REGISTRY.default_ports(port)[RANKING]}", timeout=10.0) as ranking:
            precision_text = ranking.info().details.get("precision", form)
        with RecommendClient(target, timeout=120.0) as client:
            client.info()  # the client's own connection, made before the first timed call
            for k in counts:
                calls = []
                for _ in range(2):
                    t = time.perf_counter()
                    try:
                        rec = client.recommend(user_id=7, num_candidates=k, num_results=min(10, k))
                    except RecpipeError as e:  # a stalled stage: the call's error is the measurement
                        calls.append({"e2e_ms": (time.perf_counter() - t) * 1e3, "error": str(e)[:200]})
                        continue
                    calls.append({"e2e_ms": (time.perf_counter() - t) * 1e3,
                                  **{f"{s.stage}_ms": s.server_us / 1e3 for s in rec.timings}})
                rows.append({"count": k, "first": calls[0], "second": calls[1]})
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log_path.read_text(errors="replace")
    restarts = [line for line in text.splitlines() if any(m in line for m in RESTART_MARKS)]
    return {"precision": form, "ranking": precision_text, "serving_s": round(serving_s, 2),
            "quiet_s": round(quiet_s, 2), "calls": rows,
            "restarts": restarts, "log": str(log_path)}


#: the chain counts as quiet once its processes use less than this share of one core over ``QUIET_S``
QUIET_CORES = 0.05
QUIET_S = 1.0


def _wait_quiet(pid: int, timeout: float) -> float:
    """Wait until ``pid`` and its descendants (the stages, and the warm standbys ``recpipe serve`` starts
    once the chain is SERVING) are idle, so that the first calls are timed on the chain alone and not
    beside the standbys' imports and compilation; returns the monotonic instant."""
    from recpipe.cputime import cpu_seconds

    def tree_cpu() -> float:
        pids, total = {pid}, 0.0
        for path in Path("/proc").iterdir():
            if path.name.isdigit():
                try:
                    stat = (path / "stat").read_text()
                    if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                        pids.add(int(path.name))
                except (OSError, ValueError, IndexError):
                    continue
        for p in pids:
            total += cpu_seconds(p) or 0.0
        return total

    until = time.monotonic() + timeout
    last = tree_cpu()
    while time.monotonic() < until:
        time.sleep(QUIET_S)
        now = tree_cpu()
        if now - last < QUIET_CORES * QUIET_S:
            break
        last = now
    return time.monotonic()


def _free_block(free_port: Any) -> int:
    """A port whose next ones are free too (the chain's stages take port + their offsets)."""
    import socket

    from recpipe.stages import REGISTRY

    for _ in range(50):
        port = free_port(DEFAULT_HOST)
        try:
            for p in REGISTRY.default_ports(port).values():
                with socket.socket() as s:
                    s.bind((DEFAULT_HOST, p))
        except OSError:
            continue
        return port
    raise UsageError("no block of four free ports on the loopback address")


def _print(results: list[dict[str, Any]]) -> None:
    for r in results:
        print(f"\n--ranking-precision {r['precision']}: SERVING after {r['serving_s']:.1f} s, quiet (standbys "
              f"loaded) after {r['quiet_s']:.1f} s; restarts in the serve log: {len(r['restarts'])}")
        stages = next((list(k for k in c if k.endswith("_ms") and k != "e2e_ms") for row in r["calls"]
                       for c in (row["first"], row["second"]) if "error" not in c), [])
        print(f"{'candidates':>10} {'first ms':>9} {'second ms':>10} {'ratio':>6}  " +
              "  ".join(f"{s.removesuffix('_ms')} 1st/2nd" for s in stages))
        for row in r["calls"]:
            first, second = row["first"], row["second"]
            if "error" in first or "error" in second:
                err = first.get("error") or second.get("error")
                print(f"{row['count']:>10} {first['e2e_ms']:>9.2f} {second['e2e_ms']:>10.2f}  failed: {err}")
                continue
            per_stage = "  ".join(f"{first.get(s, 0):>7.2f}/{second.get(s, 0):<7.2f}" for s in stages)
            print(f"{row['count']:>10} {first['e2e_ms']:>9.2f} {second['e2e_ms']:>10.2f} "
                  f"{first['e2e_ms'] / second['e2e_ms']:>5.2f}x  {per_stage}")
        for line in r["restarts"]:
            print(f"  serve log: {line}")
