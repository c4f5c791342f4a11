"""Generate the synthetic users/items/interactions dataset (Parquet) with planted structure.

Writes DIR/users.parquet, DIR/items.parquet, DIR/interactions.parquet and DIR/manifest.json
(row counts, sha256 per file, the time split, and the oracle AUC/recall@500 of the true click model).
Same --seed and --scale give byte-identical files.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from recpipe.config import DEFAULT_DATA_DIR
from recpipe.errors import UsageError


def _seed(text: str) -> int:
    from recpipe.datagen.config import MAX_SEED

    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..{MAX_SEED}, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..{MAX_SEED}, got {text!r}")
    return value


def _scale(text: str) -> float:
    from recpipe.datagen.config import MAX_SCALE

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_SCALE:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 and <= {MAX_SCALE:g}, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from recpipe.datagen.config import MAX_SCALE

    parser.add_argument("--out", default=DEFAULT_DATA_DIR, metavar="DIR",
                        help=f"dataset directory to create (default: {DEFAULT_DATA_DIR})")
    parser.add_argument("--scale", type=_scale, default=1.0, metavar="F",
                        help="multiply every row count by F (1 = 221k users, 850k items, 4M interactions; "
                             f"at most {MAX_SCALE:g})")
    parser.add_argument("--seed", type=_seed, default=0, metavar="N", help="random seed, 0..2**63-1 (default 0)")
    parser.add_argument("--force", action="store_true", help="replace an existing dataset in DIR")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


def run(args: argparse.Namespace) -> int:
    from recpipe.datagen import DatagenConfig, generate

    cfg = DatagenConfig(scale=args.scale, seed=args.seed)
    interactive = not args.quiet and sys.stderr.isatty()
    t0 = time.perf_counter()
    try:
        manifest = generate(cfg, args.out, force=args.force, progress=interactive)
    except OSError as e:  # disk full, permissions changed mid-run: the temporary directory is gone already
        raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from None
    if not args.quiet:
        # The summary goes to stdout whether or not it is a terminal; only the progress bar needs one.
        rows, orc = manifest["rows"], manifest["oracle"]

        def num(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.3f}"

        print(f"wrote {args.out}: {rows['users']:,} users, {rows['items']:,} items, "
              f"{rows['interactions']:,} interactions in {time.perf_counter() - t0:.1f} s "
              f"(click rate {num(manifest['stats']['click_rate'])}, oracle AUC {num(orc['auc'])}, "
              f"oracle recall@500 {num(orc['recall_at_500'])})")
    return 0
