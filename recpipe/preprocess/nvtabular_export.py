"""Fit recpipe's preprocessing with an NVTabular workflow and export recpipe's own artifacts.

Runs INSIDE the isolated NVTabular environment (``.ci/nvtabular-env.sh DIR``), never in the serving
one: it imports only nvtabular, pandas, pyarrow, numpy and the standard library, and nothing from
recpipe (whose modules pull in Polars and torch). ``recpipe.preprocess.nvtabular_engine`` runs it as
``DIR/bin/python nvtabular_export.py --spec SPEC --out OUT --users U --items I`` where U and I hold
the user and item rows of the training split (the caller decides the split, so both engines fit on
exactly the same rows).

The workflow per table (users, items)::

    plain continuous  >> Normalize >> FillMissing(0)
    heavy continuous  >> Clip(min_value=0) >> LogOp >> LambdaOp(float64) >> Normalize >> FillMissing(0)
    categorical       >> Categorify

Its fitted statistics (Normalize's mean/std, Categorify's per-value counts) are written as
``vocab_<table>.parquet`` (column, value, index, count) and ``stats.json`` -- the files
``recpipe.preprocess.Preprocessor.load`` reads. The fitted workflow itself (a pickle) is never
written. Two things are recpipe's, not NVTabular's, and are applied here to its counts:

* the ranking: NVTabular sorts the uniques by count with an unstable sort, so ties come out in
  arbitrary order (and ``max_size`` would cut among them arbitrarily). Values are therefore ranked by
  (count descending, value ascending) and cut at ``max_vocab - 1`` here, as the Polars engine does.
* the index layout: NVTabular reserves 0 (pad), 1 (null) and 2 (OOV) and numbers values from 3;
  recpipe has one bucket 0 for null/unseen/beyond-the-cap and numbers values from 1.

The spec (JSON, written by the engine from ``recpipe.schema``) names the columns::

    {"max_vocab": 50000,
     "tables": {"users": {"continuous": [{"name": "u_cont_00", "log1p": false}, ...],
                          "categorical": ["u_cat_00", ...]},
                "items": {...}}}

On success the last line of stdout is one JSON object of timings (seconds): ``import``, ``read``,
``fit``, ``export`` and the NVTabular version. Errors: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

T_START = time.perf_counter()

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

STATS_FILE = "stats.json"
MIN_STD = 1e-8


class ExportError(Exception):
    """Bad input to the exporter: reported as one line and exit code 2."""


def vocab_file(table: str) -> str:
    return f"vocab_{table}.parquet"


# ---- input ----------------------------------------------------------------------------------------


def read_spec(path: Path) -> dict[str, Any]:
    try:
        spec = json.loads(path.read_text())
        int(spec["max_vocab"])
        for table in ("users", "items"):
            t = spec["tables"][table]
            [(str(c["name"]), bool(c["log1p"])) for c in t["continuous"]]
            [str(c) for c in t["categorical"]]
    except FileNotFoundError:
        raise ExportError(f"--spec {path}: no such file") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"--spec {path}: malformed spec ({e!r})") from None
    if int(spec["max_vocab"]) < 2:
        raise ExportError(f"--spec {path}: max_vocab must be >= 2")
    return spec


def _read_parquet(path: Path, columns: list[str]) -> pd.DataFrame:
    try:
        table = pq.read_table(path, columns=columns)
    except FileNotFoundError:
        raise ExportError(f"{path}: no such file") from None
    except (OSError, pa.ArrowException, KeyError) as e:
        raise ExportError(f"{path}: unreadable or missing columns ({e})") from None
    return table.to_pandas()


def _table_columns(t: dict[str, Any]) -> list[str]:
    return [c["name"] for c in t["continuous"]] + list(t["categorical"])


def read_training_rows(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """The rows of users and items to fit on (the training split, selected by the caller)."""
    frames: dict[str, pd.DataFrame] = {}
    for table, path in (("users", args.users), ("items", args.items)):
        frames[table] = _read_parquet(path, _table_columns(spec["tables"][table]))
    for table, frame in frames.items():
        t = spec["tables"][table]
        # recpipe computes in float64 (Polars cast); NVTabular's moments then match to rounding
        for c in t["continuous"]:
            frame[c["name"]] = frame[c["name"]].astype(np.float64)
        frames[table] = frame[_table_columns(t)].reset_index(drop=True)
    return frames


# ---- fit ------------------------------------------------------------------------------------------


def _float64(column: pd.Series) -> pd.Series:
    return column.astype(np.float64)


def fit_table(frame: pd.DataFrame, t: dict[str, Any], work: Path) -> tuple[Any, dict[str, tuple[float, float]],
                                                                            dict[str, Path]]:
    """Fit the NVTabular workflow on one table; returns it, {column: (mean, std)}, {column: uniques file}."""
    import nvtabular as nvt
    from nvtabular import ops

    plain = [c["name"] for c in t["continuous"] if not c["log1p"]]
    heavy = [c["name"] for c in t["continuous"] if c["log1p"]]
    cats = list(t["categorical"])
    parts = []
    if plain:
        parts.append(plain >> ops.Normalize() >> ops.FillMissing(fill_val=0.0))
    if heavy:
        # LogOp returns float32, and Normalize's moments would then sum it in float32: on 200k rows the
        # sum-of-squares variance loses ~5e-6 of std to that, 2e-5 in the normalized values. Float64 it is.
        parts.append(heavy >> ops.Clip(min_value=0.0) >> ops.LogOp() >> ops.LambdaOp(_float64, dtype=np.float64)
                     >> ops.Normalize() >> ops.FillMissing(fill_val=0.0))
    if cats:
        # no max_size: the cap is applied after recpipe's deterministic ranking (see the module docstring)
        parts.append(cats >> ops.Categorify(out_path=str(work)))
    graph = parts[0]
    for p in parts[1:]:
        graph = graph + p
    workflow = nvt.Workflow(graph)
    workflow.fit(nvt.Dataset(frame, cpu=True))

    moments: dict[str, tuple[float, float]] = {}
    uniques: dict[str, Path] = {}
    seen: set[int] = set()
    stack = [workflow.output_node]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        op = node.op
        if isinstance(op, ops.Normalize):
            for name, mean in op.means.items():
                moments[name] = (mean, op.stds[name])
        elif isinstance(op, ops.Categorify):
            for name, path in op.categories.items():
                uniques[name] = Path(path)
        stack.extend(node.parents_with_dependencies)
    missing = [c for c in plain + heavy if c not in moments] + [c for c in cats if c not in uniques]
    if missing:
        raise RuntimeError(f"the fitted workflow has no statistics for {missing}")
    return workflow, moments, uniques


def ranked_vocab(uniques: Path, name: str, max_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, counts) of one column from Categorify's uniques, ranked and capped as recpipe does."""
    frame = pq.read_table(uniques).to_pandas()
    frame = frame[frame[name].notna() & (frame[f"{name}_size"] > 0)]
    values = frame[name].to_numpy().astype(np.int64)
    counts = frame[f"{name}_size"].to_numpy().astype(np.int64)
    order = np.lexsort((values, -counts))[: max_vocab - 1]
    return values[order], counts[order]


def _finite_or(x: float, default: float) -> float:
    return float(x) if x is not None and math.isfinite(x) else default


# ---- export ---------------------------------------------------------------------------------------


def _write_atomic(path: Path, write: Any) -> None:
    """``recpipe.files.write_atomic``'s steps (this script cannot import recpipe, see above)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync(path.parent)


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export(frames: dict[str, pd.DataFrame], spec: dict[str, Any], out: Path) -> dict[str, float]:
    max_vocab = int(spec["max_vocab"])
    stats: dict[str, Any] = {"max_vocab": max_vocab, "tables": {}}
    vocab_tables: dict[str, pa.Table] = {}
    t_fit = 0.0
    with tempfile.TemporaryDirectory(prefix="nvt-fit-") as work:
        for table in ("users", "items"):
            t = spec["tables"][table]
            t0 = time.perf_counter()
            _, moments, uniques = fit_table(frames[table], t, Path(work) / table)
            t_fit += time.perf_counter() - t0
            continuous = []
            for c in t["continuous"]:
                mean, std = moments[c["name"]]
                std = _finite_or(std, 1.0)
                continuous.append({"name": c["name"], "log1p": bool(c["log1p"]), "mean": _finite_or(mean, 0.0),
                                   "std": std if std >= MIN_STD else 1.0})
            columns, values, indices, counts, categorical = [], [], [], [], []
            for name in t["categorical"]:
                v, n = ranked_vocab(uniques[name], name, max_vocab)
                columns += [name] * len(v)
                values.append(v)
                indices.append(np.arange(1, len(v) + 1, dtype=np.int64))
                counts.append(n)
                categorical.append({"name": name, "size": len(v) + 1})
            stats["tables"][table] = {"continuous": continuous, "categorical": categorical}
            empty = np.zeros(0, np.int64)
            vocab_tables[table] = pa.table(
                {
                    "column": pa.array(columns, pa.string()),
                    "value": pa.array(np.concatenate(values) if values else empty, pa.int64()),
                    "index": pa.array(np.concatenate(indices) if indices else empty, pa.int64()),
                    "count": pa.array(np.concatenate(counts) if counts else empty, pa.int64()),
                }
            )
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    for table, vt in vocab_tables.items():
        _write_atomic(out / vocab_file(table), lambda tmp, vt=vt: pq.write_table(vt, tmp))
    text = json.dumps(stats, indent=2, sort_keys=True) + "\n"
    _write_atomic(out / STATS_FILE, lambda tmp: Path(tmp).write_text(text))
    return {"fit": t_fit, "export": time.perf_counter() - t0}


# ---- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvtabular_export", description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, required=True, help="columns and settings (JSON, see the module docstring)")
    p.add_argument("--out", type=Path, required=True, help="directory for vocab_<table>.parquet and stats.json")
    p.add_argument("--users", type=Path, required=True, help="Parquet of the user rows of the training split")
    p.add_argument("--items", type=Path, required=True, help="Parquet of the item rows of the training split")
    p.add_argument("--force", action="store_true", help="replace artifacts already in --out")
    return p


def main(argv: list[str] | None = None) -> int:
    t_import = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:
        existing = [f for f in (vocab_file("users"), vocab_file("items"), STATS_FILE) if (args.out / f).exists()]
        if existing and not args.force:
            raise ExportError(f"--out {args.out} already holds {existing[0]}; pass --force to replace it")
        spec = read_spec(args.spec)
        t0 = time.perf_counter()
        frames = read_training_rows(args, spec)
        t_read = time.perf_counter() - t0
        with warnings.catch_warnings():
            # CPU mode, and no TensorFlow/torch/Triton in this env: NVTabular says so on every import/fit
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            import nvtabular

            t_nvt_import = time.perf_counter() - t0
            timings = export(frames, spec, args.out)
    except ExportError as e:
        print(f"nvtabular_export: error: {e}", file=sys.stderr)
        return 2
    report = {
        "import": round(t_import - T_START + t_nvt_import, 4),
        "read": round(t_read, 4),
        "fit": round(timings["fit"], 4),
        "export": round(timings["export"], 4),
        "rows": {table: len(frame) for table, frame in frames.items()},
        "nvtabular": nvtabular.__version__,
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
