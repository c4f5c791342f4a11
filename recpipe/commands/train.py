"""Fit preprocessing, train two-tower retrieval and DLRM ranking, build the FAISS index."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recpipe.config import DEFAULT_MODELS_DIR
from recpipe.errors import UsageError

INDEX_CHOICES = ("auto", "flat", "ivf", "ivfsq8", "ivfpqfs", "hnsw")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
PREPROCESS_CHOICES = ("polars", "nvtabular")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, metavar="DIR", help="dataset written by `recpipe synth-data`")
    parser.add_argument("--out", default=DEFAULT_MODELS_DIR, metavar="MODELS_DIR",
                        help=f"model repository to write (default {DEFAULT_MODELS_DIR}/)")
    parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    parser.add_argument("--epochs", type=int, default=None, help="epochs for both models (default: 2 for the two-tower; for the DLRM 8 with dot and "
                        "at most 4 with dcn, or 4M rows in all: four at full scale)")
    parser.add_argument("--val-fraction", type=float, default=None, metavar="F",
                        help="hold back the latest share F of the training rows to choose the DLRM's epoch "
                             "(stop early, keep the best); 0 trains on every row and keeps the last epoch "
                             "(default: 0 for dot, 0.1 for dcn, whose cross layers memorise)")
    parser.add_argument("--seed", type=int, default=0, help="random seed, 0..2**31-1 (default 0)")
    parser.add_argument("--index", default="auto", choices=INDEX_CHOICES,
                        help="FAISS index; auto = the fastest at k = 500 reaching recall@500 >= 0.95 against exact search")
    parser.add_argument("--preprocess", default="polars", choices=PREPROCESS_CHOICES,
                        help="engine fitting the preprocessing (default polars); nvtabular runs in its own "
                             "environment and exports the same artifacts")
    parser.add_argument("--nvtabular-python", default=None, metavar="PATH",
                        help="interpreter of the NVTabular environment (default $RECPIPE_NVTABULAR_PYTHON; "
                             "create one with .ci/nvtabular-env.sh DIR)")
    parser.add_argument("--interaction", default="dot", choices=("dot", "dcn"),
                        help="DLRM feature interaction: dot (pairwise dots, default) or dcn (DCNv2 low-rank cross "
                             "layers, as in MLPerf DLRM-v2)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch compute threads (0 = auto: a thread per core; 1 on machines with <= 2 cores "
                             "when OMP_WAIT_POLICY is set to anything but PASSIVE, the policy recpipe train runs torch under "
                             "unless you set one)")
    parser.add_argument("--force", action="store_true", help="replace an existing model repository")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


def run(args: argparse.Namespace) -> int:
    from recpipe.bench._args import within
    from recpipe.training.config import MAX_SEED, MAX_THREADS, TrainConfig

    if args.epochs is not None and args.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {args.epochs}")
    within(0, MAX_THREADS, ("--threads", args.threads))
    within(0, MAX_SEED, ("--seed", args.seed))
    if args.val_fraction is not None and not 0 <= args.val_fraction < 0.5:
        raise UsageError(f"--val-fraction must be in [0, 0.5), got {args.val_fraction}")
    data = Path(args.data)
    if not data.is_dir():
        raise UsageError(f"--data {data}: no such directory")
    nvt_python = None
    if args.preprocess == "nvtabular":
        from recpipe.preprocess.nvtabular_engine import find_python

        # before any data is read: a missing environment is a usage error, not a late failure
        nvt_python = find_python(args.nvtabular_python)
    cfg = TrainConfig(
        epochs=args.epochs,
        seed=args.seed,
        device=args.device,
        index=args.index,
        threads=args.threads,
        interaction=args.interaction,
        ranking_val_fraction=args.val_fraction,
        progress=not args.quiet,
    )

    from recpipe.training.threads import import_with_sleeping_workers

    import_with_sleeping_workers()  # before anything else loads torch: OpenMP reads the policy once
    from recpipe.training.pipeline import train

    def say(line: str) -> None:
        if not args.quiet:
            print(f"  {line}", file=sys.stderr, flush=True)

    engine = {}
    if nvt_python is not None:
        import functools

        from recpipe.preprocess import nvtabular_engine

        engine["fit_preprocessor"] = functools.partial(nvtabular_engine.fit, python=nvt_python, say=say)
    manifest = train(data, Path(args.out), cfg, force=args.force, say=say, **engine)
    if not args.quiet:
        m = manifest["metrics"]
        print(f"wrote {args.out} (version {manifest['version']}, {manifest['training']['device']}, "
              f"{manifest['training']['seconds']['total']:.1f}s)")
        print(f"  ranking_auc {m['ranking_auc']:.4f} (oracle {_round(m['oracle_auc'])}), {m['ranking_interaction']} "
              f"interaction, epoch {m['ranking_epoch']} of {m['ranking_epochs_run']} run: train AUC "
              f"{_round(m['ranking_train_auc'])}"
              + ("" if m["ranking_val_auc"] is None else f", validation AUC {_round(m['ranking_val_auc'])}"))
        dlrm = manifest["training"]["dlrm"]
        frozen = dlrm.get("frozen_tables") or []
        print(f"  dlrm tables: {len(frozen)} too sparse to learn, kept at zero"
              + (f" ({', '.join(frozen)})" if frozen else "")
              + (f"; {dlrm['exposure_table']} started from exposure" if dlrm.get("exposure_table") else "")
              + (f"; a wide part over the signal columns and {dlrm['wide_table']}" if dlrm.get("wide_table") else ""))
        print("  ranking_auc by served precision: "
              + ", ".join(f"{k} {v:.4f}" for k, v in m["ranking_auc_by_precision"].items()))
        seconds = manifest["training"]["seconds"]
        print("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items() if k != "total"))
        print(f"  retrieval_recall_at_500 {m['retrieval_recall_at_500']:.4f} "
              f"(popularity {m['popularity_recall_at_500']:.4f})")
        print(f"  index {m['index_type']}: recall@100 {m['index_recall_at_100']:.4f}")
    return 0


def _round(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
