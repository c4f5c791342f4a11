"""Fit time of the preprocessing: the Polars engine (in process) against NVTabular (its own env).

Both fit the same rows: the users and items of the training split of ``--data``, selected as
``recpipe train`` selects them. Polars runs ``Preprocessor.fit`` in this process. NVTabular runs the
exporter under ``--nvtabular-python`` (default ``$RECPIPE_NVTABULAR_PYTHON``) as ``recpipe train
--preprocess nvtabular`` does; its time is split into the exporter's own figures (``fit`` = the
workflow fits, ``import``, ``read``, ``export``) and the whole subprocess (interpreter start-up
included), plus writing the rows for it. Rounds alternate the engines; medians are reported, with
each NVTabular figure as a ratio to the Polars fit. The exported artifacts are checked to hold the
same vocabularies and statistics as the Polars fit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from recpipe.bench._args import at_least, check_out, require_dirs
from recpipe.config import DEFAULT_DATA_DIR
from recpipe.files import write_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR), help="dataset of `recpipe synth-data`")
    parser.add_argument("--nvtabular-python", default=None, metavar="PATH",
                        help="interpreter of the NVTabular environment (default $RECPIPE_NVTABULAR_PYTHON)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of (Polars, NVTabular) (default 1)")
    parser.add_argument("--max-vocab", type=int, default=50_000)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")


def run(args: argparse.Namespace) -> int:
    at_least(1, ("--repeat", args.repeat))
    at_least(2, ("--max-vocab", args.max_vocab))
    require_dirs(("--data", args.data))
    check_out("--out", args.out, args.force)  # before the run, not after it
    import numpy as np
    import polars as pl

    from recpipe.features.core import read_tables
    from recpipe.preprocess import PreprocessConfig, Preprocessor
    from recpipe.preprocess import nvtabular_engine as nvt
    from recpipe.timesplit import split_by_time

    python = nvt.find_python(args.nvtabular_python)
    config = PreprocessConfig(args.max_vocab)
    users, items, interactions = read_tables(args.data)
    train, _ = split_by_time(interactions)
    users = users.filter(pl.col("user_id").is_in(train["user_id"].unique().implode()))
    items = items.filter(pl.col("item_id").is_in(train["item_id"].unique().implode()))

    rows: dict[str, list[float]] = {k: [] for k in ("polars", "write_rows", "import", "read", "fit", "export",
                                                   "subprocess")}
    polars_prep = nvt_prep = None
    version = "?"
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        polars_prep = Preprocessor.fit(users, items, config)
        rows["polars"].append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory(prefix="recpipe-bench-nvt-") as tmp:
            t0 = time.perf_counter()
            u, i = nvt.write_rows(users, items, Path(tmp))
            rows["write_rows"].append(time.perf_counter() - t0)
            result = nvt.run_exporter(python, Path(tmp) / "out", config, users=u, items=i)
            nvt_prep = nvt.load_exported(result.out, config)
        rows["subprocess"].append(result.wall)
        for k in ("import", "read", "fit", "export"):
            rows[k].append(float(result.timings[k]))
        version = str(result.timings.get("nvtabular"))
    assert polars_prep is not None and nvt_prep is not None
    med = {k: statistics.median(v) for k, v in rows.items()}

    same_vocab = all(
        np.array_equal(a.values, b.values) and np.array_equal(a.counts, b.counts)
        for t in ("users", "items") for a, b in zip(polars_prep.vocabs[t], nvt_prep.vocabs[t], strict=True)
    )
    stat_diff = max(
        max(abs(a.mean - b.mean) / a.std, abs(a.std - b.std) / a.std)
        for t in ("users", "items") for a, b in zip(polars_prep.continuous[t], nvt_prep.continuous[t], strict=True)
    )
    polars_s = med["polars"]
    print(f"preprocess bench: {args.data}, training rows: {users.height} users, {items.height} items; "
          f"{args.repeat} round(s), medians; NVTabular {version} on CPU")
    print(f"{'engine / part':<34}{'seconds':>9}{'/ Polars fit':>14}")
    lines = [
        ("polars  Preprocessor.fit", polars_s),
        ("nvtabular  workflow fit", med["fit"]),
        ("nvtabular  fit + read + export", med["fit"] + med["read"] + med["export"]),
        ("nvtabular  imports", med["import"]),
        ("nvtabular  subprocess (all)", med["subprocess"]),
        ("nvtabular  subprocess + write rows", med["subprocess"] + med["write_rows"]),
    ]
    for name, secs in lines:
        print(f"{name:<34}{secs:>9.2f}{secs / polars_s:>13.1f}x")
    print(f"same vocabularies: {'yes' if same_vocab else 'NO'}; largest mean/std difference "
          f"(in stds): {stat_diff:.2e}")
    if args.out is not None:
        doc = {"data": str(args.data), "repeat": args.repeat, "nvtabular": version, "median_seconds": med,
               "samples": rows, "same_vocabularies": same_vocab, "max_stat_difference": stat_diff}
        write_atomic(args.out, json.dumps(doc, indent=2) + "\n", force=args.force)
    return 0 if same_vocab else 1
