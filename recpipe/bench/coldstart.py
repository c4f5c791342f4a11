"""Cold start: exec of ``python -m recpipe serve --stage NAME`` until its health service says SERVING.

Each stage is started as a real process on a free loopback port, its health polled every
``--poll-ms``, and stopped (SIGTERM) once it is SERVING; ``--repeats`` rounds alternate stage by
stage, and with ``--source DIR`` (another checkout's root, e.g. ``git archive`` of the baseline) each
stage's start alternates between that tree and this one, so both share the machine's noise.
``--breakdown`` adds, per stage and tree, the seconds to import its modules (``python -c 'import
…'``, no artifacts read): the floor a start cannot go below without importing less.
``cold_start`` is the function ``bench overload --kill`` and the tests can reuse.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from recpipe.bench._args import above, at_least, require_dirs
from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_MODELS_DIR
from recpipe.errors import UsageError
from recpipe.stages import REGISTRY

STAGES = REGISTRY.names


def _imports(stage: str) -> str:
    """What a stage's process imports before it loads anything (for ``--breakdown``)."""
    return f"recpipe.{stage}.servicer"


@dataclass(frozen=True)
class ColdStart:
    stage: str
    source: str
    serving_s: float  # exec -> health SERVING
    pid: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR))
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--stage", default="features,retrieval,ranking",
                        help="stages to start, comma-separated (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--source", type=Path, default=None,
                        help="another source tree to start the same stages from, alternating (the baseline)")
    parser.add_argument("--source-models", type=Path, default=None,
                        help="model repository for the --source tree (default --models; a baseline may not read "
                             "a repository trained by this tree)")
    parser.add_argument("--breakdown", action="store_true", help="also time each stage's imports alone")
    parser.add_argument("--poll-ms", type=float, default=10.0, help="health poll interval (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a start may take (default %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="--threads of the stage (default %(default)s)")


def stage_command(stage: str, models: Path, data: Path, port: int, threads: int = 1) -> list[str]:
    return [sys.executable, "-m", "recpipe", "serve", "--stage", stage, "--models", str(models), "--data", str(data),
            "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1", "--device", "cpu",
            "--threads", str(threads)]


def _env(source: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source.resolve()), *filter(None, [env.get("PYTHONPATH")])])
    return env


def start(stage: str, models: Path, data: Path, port: int, *, source: Path | None = None, threads: int = 1,
          cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """The stage's process (its output discarded), started now."""
    return subprocess.Popen(stage_command(stage, models, data, port, threads), env=_env(source),
                            cwd=str(cwd or (source or Path.cwd())), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)


def wait_serving(proc: subprocess.Popen[bytes], address: str, t0: float, timeout: float = 120.0,
                 poll_s: float = 0.01) -> float:
    """Seconds from ``t0`` (before exec) until ``address`` answers its health check with SERVING."""
    from recpipe.serving.channels import make_blocking_channel
    from recpipe.serving.supervisor import health_status

    channel = make_blocking_channel(address)
    try:
        while True:
            if health_status(channel, timeout=0.5) == "SERVING":
                return time.perf_counter() - t0
            if proc.poll() is not None:
                err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace").strip().splitlines()
                raise RuntimeError(f"stage exited with {proc.returncode} before SERVING: {err[-1] if err else ''}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"not SERVING after {timeout:.0f} s")
            time.sleep(poll_s)
    finally:
        channel.close()


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr:
        proc.stderr.close()


def cold_start(stage: str, models: Path, data: Path, *, source: Path | None = None, threads: int = 1,
               timeout: float = 120.0, poll_s: float = 0.01) -> ColdStart:
    """Start ``stage``, time exec -> SERVING, stop it."""
    from recpipe.serving.supervisor import free_port

    port = free_port()
    t0 = time.perf_counter()
    proc = start(stage, models, data, port, source=source, threads=threads)
    try:
        took = wait_serving(proc, f"127.0.0.1:{port}", t0, timeout, poll_s)
    finally:
        stop(proc)
    return ColdStart(stage, str(source or "this tree"), took, proc.pid)


def import_seconds(stage: str, source: Path | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {_imports(stage)}"], env=_env(source), check=True,
                   cwd=str(source or Path.cwd()))
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    stages = [s.strip() for s in args.stage.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if not stages or unknown:
        raise UsageError(f"--stage: choose from {', '.join(STAGES)} (got {args.stage!r})")
    at_least(1, ("--repeats", args.repeats))
    above(0, ("--poll-ms", args.poll_ms), ("--timeout", args.timeout))
    at_least(0, ("--threads", args.threads))
    require_dirs(("--models", args.models), ("--data", args.data))
    if args.source is not None and not (args.source / "recpipe" / "__init__.py").is_file():
        raise UsageError(f"--source {args.source}: not a recpipe source tree (no recpipe/__init__.py)")
    import numpy as np

    models, data = args.models.resolve(), args.data.resolve()
    source_models = (args.source_models or args.models).resolve()
    if not source_models.is_dir():
        raise UsageError(f"--source-models {source_models}: no such directory")
    sources: list[Path | None] = [args.source, None] if args.source is not None else [None]
    label = {None: "this tree"} | ({args.source: f"--source {args.source}"} if args.source else {})
    took: dict[tuple[str, Path | None], list[float]] = {}
    imports: dict[tuple[str, Path | None], list[float]] = {}
    for _ in range(args.repeats):
        for stage in stages:
            for src in sources:
                r = cold_start(stage, models if src is None else source_models, data, source=src, threads=args.threads, timeout=args.timeout,
                               poll_s=args.poll_ms / 1e3)
                took.setdefault((stage, src), []).append(r.serving_s)
                if args.breakdown:
                    imports.setdefault((stage, src), []).append(import_seconds(stage, src))
    print(f"cold start, exec -> SERVING, {args.repeats} rounds alternating, --threads {args.threads}, "
          f"models {models}")
    print(f"{'stage':<10} {'tree':<34} {'p50 s':>7} {'min s':>7} {'max s':>7}" + (f" {'imports s':>10}" if imports else ""))
    for stage in stages:
        for src in sources:
            t = np.asarray(took[(stage, src)])
            line = f"{stage:<10} {label[src]:<34} {np.median(t):>7.2f} {t.min():>7.2f} {t.max():>7.2f}"
            if imports:
                line += f" {np.median(imports[(stage, src)]):>10.2f}"
            print(line)
        if args.source is not None:
            base, new = np.median(took[(stage, args.source)]), np.median(took[(stage, None)])
            print(f"{stage:<10} {'ratio baseline / this tree':<34} {base / new:>7.2f}x")
    return 0
