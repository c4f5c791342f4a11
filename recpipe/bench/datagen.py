"""Time `synth-data` beside a naive writer of random columns of the same shape (wall, CPU, peak RSS).

Each form runs in its own child process (``python -m recpipe.bench.datagen FORM SCALE DIR``) so that
its peak RSS is its own (``os.wait4`` reports the child's rusage); forms alternate over ``--repeat``
rounds and the median is reported, so both see the same machine load. The naive form draws uniform
random columns with the schema's names, dtypes and row counts and writes each table with
``pyarrow.parquet.write_table`` defaults, all in memory: no structure, no oracle, no checksums.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recpipe.errors import UsageError
from recpipe.files import check_creatable

FORMS = ("naive", "synth-data")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", type=float, default=1.0, help="dataset scale (default 1)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of (naive, synth-data) (default 1)")
    parser.add_argument("--tmp", default=None, metavar="DIR", help="where to write (default: system temp)")


def _naive(scale: float, out: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recpipe import schema

    rng = np.random.default_rng(0)
    for table in schema.TABLES:
        n = table.rows_at(scale)
        cols: dict[str, np.ndarray] = {}
        for c in table.columns:
            if c.dtype == "float32":
                cols[c.name] = rng.random(n, dtype=np.float32)
            elif c.kind is schema.Kind.CATEGORICAL:
                cols[c.name] = rng.integers(0, c.cardinality_at(scale), n, dtype=np.int32)
            else:
                cols[c.name] = rng.integers(0, max(2, n), n).astype(c.dtype)
        pq.write_table(pa.table(cols), out / schema.TABLE_FILES[table.name])


def _real(scale: float, out: Path) -> None:
    from recpipe.datagen import DatagenConfig, generate

    generate(DatagenConfig(scale=scale, seed=0), out / "data")


def _child(form: str, scale: float, out: Path) -> None:
    (_naive if form == "naive" else _real)(scale, out)


def _run_child(form: str, scale: float, tmp: Path) -> tuple[float, float, float]:
    """(wall seconds, peak RSS in MiB, CPU seconds) of one child run."""
    out = Path(tempfile.mkdtemp(prefix=f"bench-{form}-", dir=tmp))
    try:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "recpipe.bench.datagen", form, repr(scale), str(out)])
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise RuntimeError(f"bench child {form!r} failed with exit code {proc.returncode}")
        return wall, usage.ru_maxrss / 1024.0, usage.ru_utime + usage.ru_stime  # Linux: ru_maxrss in KiB
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.scale <= 100:
        raise UsageError(f"--scale must be in (0, 100], got {args.scale}")
    if args.repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {args.repeat}")
    tmp = Path(args.tmp) if args.tmp else Path(tempfile.gettempdir())
    if not tmp.is_dir():
        raise UsageError(f"--tmp {tmp} is not a directory")
    try:
        check_creatable(tmp)  # now, not once the first round has run
    except UsageError as e:
        raise UsageError(f"--tmp: {e}") from None
    results: dict[str, list[tuple[float, float, float]]] = {f: [] for f in FORMS}
    for _ in range(args.repeat):
        for form in FORMS:
            results[form].append(_run_child(form, args.scale, tmp))
    print(f"datagen bench: scale {args.scale:g}, {args.repeat} round(s), medians per form "
          f"(cpus: {os.cpu_count()}, load average at end: {os.getloadavg()[0]:.2f})")
    print(f"{'form':<12}{'wall s':>9}{'CPU s':>9}{'peak RSS MiB':>14}{'wall / naive':>14}{'CPU / naive':>13}")
    med = {f: [statistics.median(r[i] for r in results[f]) for i in range(3)] for f in FORMS}
    for form in FORMS:
        wall, rss, cpu = med[form]
        print(f"{form:<12}{wall:>9.2f}{cpu:>9.2f}{rss:>14.0f}{wall / med['naive'][0]:>14.2f}"
              f"{cpu / med['naive'][2]:>13.2f}")
    return 0


if __name__ == "__main__":
    _child(sys.argv[1], float(sys.argv[2]), Path(sys.argv[3]))
