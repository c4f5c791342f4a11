"""The NVTabular preprocessing engine, seen from the serving environment.

NVTabular (last release 23.08) needs NumPy < 1.25 and pandas 1.5, which the serving environment
cannot have, so it lives in its own venv (``.ci/nvtabular-env.sh DIR``, pinned by
``nvtabular-requirements.txt`` + ``nvtabular-constraints.txt`` next to this file). This module finds
that venv's interpreter, hands it the training rows and a column spec, runs
``nvtabular_export.py`` there in a subprocess, and loads the exported ``vocab_<table>.parquet`` +
``stats.json`` with the ordinary ``Preprocessor.load`` -- the same engine-neutral artifacts the Polars
engine writes. Nothing NVTabular produces besides those files (its pickled workflow) crosses over.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from recpipe.errors import ArtifactMismatch, UsageError
from recpipe.preprocess.config import PreprocessConfig
from recpipe.preprocess.encoders import STATS_FILE, TABLES, Preprocessor, vocab_file

ENV_VAR = "RECPIPE_NVTABULAR_PYTHON"
EXPORTER = Path(__file__).with_name("nvtabular_export.py")
REQUIREMENTS = Path(__file__).with_name("nvtabular-requirements.txt")
SETUP_HINT = (f"create it with `.ci/nvtabular-env.sh DIR` (pinned by {REQUIREMENTS.name}) and pass "
              f"--nvtabular-python DIR/bin/python or set {ENV_VAR}")


def find_python(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The isolated environment's interpreter: ``explicit``, else ``$RECPIPE_NVTABULAR_PYTHON``."""
    where = "--nvtabular-python"
    if explicit is None or str(explicit) == "":
        explicit, where = os.environ.get(ENV_VAR) or None, ENV_VAR
    if explicit is None:
        raise UsageError(f"the nvtabular engine needs its own Python environment; {SETUP_HINT}")
    path = Path(explicit)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise UsageError(f"{where} {path}: not an executable Python interpreter; {SETUP_HINT}")
    return path


def spec(config: PreprocessConfig) -> dict[str, Any]:
    """The column spec the exporter fits by (it imports nothing from recpipe, so it is told)."""
    return {
        "max_vocab": config.max_vocab,
        "tables": {
            name: {
                "continuous": [{"name": c.name, "log1p": c.heavy_tailed} for c in table.continuous],
                "categorical": [c.name for c in table.categorical],
            }
            for name, table in TABLES.items()
        },
    }


@dataclass(frozen=True)
class ExportRun:
    """One exporter run: the artifacts it wrote and its timings (seconds).

    ``wall`` is the whole subprocess (interpreter start-up included); ``timings`` are the exporter's
    own: ``import`` (numpy/pandas/pyarrow/nvtabular), ``read``, ``fit`` (the NVTabular workflow fits)
    and ``export`` (writing the artifacts).
    """

    out: Path
    wall: float
    timings: dict[str, Any]


def run_exporter(
    python: Path,
    out: Path,
    config: PreprocessConfig,
    users: Path,
    items: Path,
    force: bool = False,
) -> ExportRun:
    """Run ``nvtabular_export.py`` under ``python`` on the training rows in ``users``/``items`` (Parquet)."""
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / ".nvtabular-spec.json"
    spec_path.write_text(json.dumps(spec(config)))
    cmd = [str(python), str(EXPORTER), "--spec", str(spec_path), "--out", str(out),
           "--users", str(users), "--items", str(items)]
    if force:
        cmd.append("--force")
    # the isolated interpreter must see its own site-packages only, never the serving env's NumPy 2
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    except OSError as e:
        raise UsageError(f"cannot run {python} ({e}); {SETUP_HINT}") from None
    finally:
        spec_path.unlink(missing_ok=True)
    wall = time.perf_counter() - t0
    stderr = proc.stderr.strip()
    if proc.returncode != 0:
        last = stderr.splitlines()[-1] if stderr else f"exit code {proc.returncode}"
        if "No module named" in stderr:
            raise UsageError(f"{python} is not a working NVTabular environment ({last}); {SETUP_HINT}")
        if proc.returncode == 2:
            raise UsageError(last.removeprefix("nvtabular_export: error: "))
        raise ArtifactMismatch(f"the NVTabular export under {python} failed: {last}")
    try:
        timings = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ArtifactMismatch(f"the NVTabular exporter printed no timings (stdout: {proc.stdout[-200:]!r})") from None
    return ExportRun(out, wall, timings)


def load_exported(directory: Path, config: PreprocessConfig) -> Preprocessor:
    """Load (and so verify against the schema) the artifacts an exporter run wrote."""
    prep = Preprocessor.load(directory / STATS_FILE, {t: directory / vocab_file(t) for t in TABLES})
    if prep.config.max_vocab != config.max_vocab:
        raise ArtifactMismatch(f"{directory / STATS_FILE}: max_vocab {prep.config.max_vocab}, "
                               f"expected {config.max_vocab}")
    return prep


def write_rows(users: pl.DataFrame, items: pl.DataFrame, directory: Path) -> tuple[Path, Path]:
    """The training rows as Parquet for the exporter (only the columns it fits)."""
    paths = []
    for name, frame in (("users", users), ("items", items)):
        table = TABLES[name]
        path = directory / f"train_{name}.parquet"
        frame.select([c.name for c in (*table.continuous, *table.categorical)]).write_parquet(
            path, compression="uncompressed", statistics=False)
        paths.append(path)
    return paths[0], paths[1]


def fit(
    users: pl.DataFrame,
    items: pl.DataFrame,
    config: PreprocessConfig | None = None,
    python: str | os.PathLike[str] | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> Preprocessor:
    """``Preprocessor.fit`` with NVTabular: same arguments (training rows of users/items), same result."""
    config = config or PreprocessConfig()
    interpreter = find_python(python)
    with tempfile.TemporaryDirectory(prefix="recpipe-nvt-") as tmp:
        u, i = write_rows(users, items, Path(tmp))
        run = run_exporter(interpreter, Path(tmp) / "preprocess", config, users=u, items=i)
        prep = load_exported(run.out, config)
    say(f"preprocess (NVTabular {run.timings.get('nvtabular')}): fit {run.timings.get('fit', 0):.1f}s, "
        f"subprocess {run.wall:.1f}s")
    return prep
