"""``recpipe train`` end to end: split, preprocessing, both models, the index, metrics, the repository.

Everything is written into a temporary directory next to ``out`` and renamed into place at the end,
so an interrupted run never leaves a half repository. An existing repository is replaced only with
``force``, and a directory holding anything else never (``recpipe.repository.check_replaceable``); the
placeholder README of a checkout's ``models/`` is kept, and what is written follows the umask.
"""

from __future__ import annotations

import logging
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import polars as pl
import torch

import recpipe
from recpipe.accel import device as devices
from recpipe.datagen.manifest import verify as verify_dataset
from recpipe.errors import UsageError
from recpipe.features import artifacts as feature_artifacts
from recpipe.features.artifacts import FeatureConfig
from recpipe.features.core import FeatureCore, read_tables
from recpipe.filemodes import follow_umask
from recpipe.files import check_creatable, link_target, missing_dirs, remove_empty, swap_dir
from recpipe.preprocess import PreprocessConfig, Preprocessor
from recpipe.ranking import artifacts as ranking_artifacts
from recpipe.ranking import probe as ranking_probes
from recpipe.repository import (
    PLACEHOLDER_README,
    check_replaceable,
    dataset_sha256,
    is_placeholder,
    write_manifest,
)
from recpipe.retrieval import artifacts as retrieval_artifacts
from recpipe.retrieval import index as faiss_index
from recpipe.serving.threads import torch_threads
from recpipe.timesplit import split_by_time
from recpipe.training import loops, process_settings, threads
from recpipe.training.config import TrainConfig
from recpipe.training.metrics import auc, recall_at_k
from recpipe.training.precision_eval import precision_aucs
from recpipe.training.precision_eval import probe as precision_probe

log = logging.getLogger(__name__)
RECALL_K = 500


def _prepare_out(out: Path, force: bool) -> list[Path]:
    """Check ``out`` and create its parent; returns the directories created, deepest first."""
    check_replaceable(out, force)
    parent = out.parent if str(out.parent) else Path(".")
    made = missing_dirs(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        remove_empty(made)  # those it made before the one it could not
        raise UsageError(f"--out {out}: cannot create {parent}: {e.strerror or e}") from None
    try:
        check_creatable(parent)  # where the repository is built before its swap into place
    except UsageError as e:
        remove_empty(made)
        raise UsageError(f"--out {out}: {e}") from None
    return made


def _swap_into_place(tmp: Path, out: Path) -> None:
    if out.exists():
        check_replaceable(out, force=True)  # again: nothing foreign may have appeared while training
        readme = out / PLACEHOLDER_README
        if is_placeholder(readme):
            shutil.copy2(readme, tmp / PLACEHOLDER_README)  # kept (a tracked file in a checkout)
    follow_umask(tmp)  # mkdtemp made it 0700 and safetensors writes 0600
    swap_dir(tmp, out)


def _versions() -> dict[str, str]:
    return {"recpipe": recpipe.__version__, "torch": torch.__version__, "faiss": faiss.__version__,
            "polars": pl.__version__, "numpy": np.__version__, "python": platform.python_version()}


def train(
    data_dir: Path, out: Path, cfg: TrainConfig, force: bool = False, say: Callable[[str], None] = lambda s: None,
    fit_preprocessor: Callable[[pl.DataFrame, pl.DataFrame, PreprocessConfig], Preprocessor] = Preprocessor.fit,
) -> dict[str, Any]:
    """Train everything on ``data_dir`` and write the model repository to ``out``; returns its manifest.

    ``fit_preprocessor`` fits the preprocessing on the training rows of users and items: the Polars
    engine (``Preprocessor.fit``) by default, or ``recpipe.preprocess.nvtabular_engine.fit``.
    Torch's thread count is set for the run (``cfg.threads``), and on CUDA float32 matmuls run in TF32;
    the caller's settings come back when it returns or raises (``process_settings``).
    """
    dev = devices.resolve(cfg.device)
    with process_settings.training_settings(threads.training_threads(cfg.threads), tf32=dev.type == "cuda"):
        return _train(data_dir, out, cfg, dev, force, say, fit_preprocessor)


def _train(
    data_dir: Path, out: Path, cfg: TrainConfig, dev: torch.device, force: bool, say: Callable[[str], None],
    fit_preprocessor: Callable[[pl.DataFrame, pl.DataFrame, PreprocessConfig], Preprocessor],
) -> dict[str, Any]:
    data_dir, out = Path(data_dir), link_target(out)
    made = _prepare_out(out, force)
    try:
        return _train_into(data_dir, out, cfg, dev, say, fit_preprocessor)
    except BaseException:  # a failed or interrupted run leaves no directory it made for --out behind
        remove_empty(made)
        raise


def _train_into(
    data_dir: Path, out: Path, cfg: TrainConfig, dev: torch.device, say: Callable[[str], None],
    fit_preprocessor: Callable[[pl.DataFrame, pl.DataFrame, PreprocessConfig], Preprocessor],
) -> dict[str, Any]:
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str, t0: float) -> float:
        timings[name] = round(time.perf_counter() - t0, 3)
        say(f"{name}: {timings[name]:.1f}s")
        return time.perf_counter()

    t = time.perf_counter()
    data_manifest = verify_dataset(data_dir)
    users, items, interactions = read_tables(data_dir)
    train_df, holdout = split_by_time(interactions)
    if train_df.height == 0 or int(train_df["label"].sum()) == 0:
        raise UsageError(f"--data {data_dir}: the training split has no clicks to learn from")
    seen_users = train_df["user_id"].unique()
    seen_items = train_df["item_id"].unique()
    prep = fit_preprocessor(
        users.filter(pl.col("user_id").is_in(seen_users.implode())),
        items.filter(pl.col("item_id").is_in(seen_items.implode())),
        PreprocessConfig(cfg.max_vocab),
    )
    core = FeatureCore(prep, users, items, train_df, FeatureConfig(cfg.history_len))
    t = lap("preprocess", t)

    counts = core.training_counts(train_df)
    t = lap("history", t)

    rng = np.random.default_rng(cfg.seed)
    train_users = train_df["user_id"].to_numpy()
    train_items = train_df["item_id"].to_numpy()
    train_labels = train_df["label"].to_numpy().astype(np.int64)
    clicked = np.flatnonzero(train_labels == 1)
    two_tower, tt_stats = loops.train_two_tower(
        core, train_users[clicked], train_items[clicked], counts.take(clicked), cfg, dev
    )
    item_emb = loops.embed_items(two_tower, core, dev)
    t = lap("two_tower", t)

    n_q = min(core.num_users, cfg.index_queries)
    query_users = rng.choice(core.num_users, size=min(core.num_users, 2 * n_q), replace=False)
    queries = loops.embed_users(two_tower, core, query_users, dev)
    index, spec, tried = faiss_index.build_tuned(
        item_emb, queries[:n_q], cfg.index if cfg.index != "auto" else "auto", cfg.index_recall_target, cfg.seed
    )
    # recall on queries the tuning did not see
    check = queries[n_q:] if len(queries) > n_q else queries
    k100, k500 = min(100, core.num_items), min(faiss_index.SERVE_K, core.num_items)
    check_truth = faiss_index.exact_topk(check, item_emb, k500)
    faiss_index.set_search_params(index, spec, k=k100)
    index_recall = faiss_index.recall(index.search(check, k100)[1], check_truth[:, :k100])
    faiss_index.set_search_params(index, spec, k=k500)
    index_recall_500 = faiss_index.recall(index.search(check, k500)[1], check_truth)
    t = lap("index", t)

    hold_clicked = holdout.filter(pl.col("label") == 1).unique(["user_id", "item_id"])
    eval_users = hold_clicked["user_id"].unique().sort().to_numpy()
    if len(eval_users) > cfg.eval_users:
        eval_users = np.sort(rng.choice(eval_users, cfg.eval_users, replace=False))
    pairs = hold_clicked.filter(pl.col("user_id").is_in(pl.Series(eval_users).implode()))
    row_of = np.searchsorted(eval_users, pairs["user_id"].to_numpy())
    k = min(RECALL_K, core.num_items)
    faiss_index.set_search_params(index, spec, k=k)
    retrieved = index.search(loops.embed_users(two_tower, core, eval_users, dev), k)[1] if len(eval_users) else \
        np.zeros((0, k), np.int64)
    popular = np.argsort(-core.history.item_clicks, kind="stable")[:k]
    retrieval_recall = recall_at_k(retrieved, row_of, pairs["item_id"].to_numpy())
    popularity_recall = recall_at_k(np.broadcast_to(popular, (max(1, len(eval_users)), k)), row_of,
                                    pairs["item_id"].to_numpy())
    t = lap("retrieval_eval", t)

    dlrm, dl_stats = loops.train_dlrm(core, train_users, train_items, train_labels, counts, cfg, dev)
    t = lap("dlrm", t)
    eval_rows = holdout
    if eval_rows.height > cfg.max_eval_rows:
        eval_rows = eval_rows.sample(cfg.max_eval_rows, seed=cfg.seed)
    scores = loops.score_dlrm(dlrm, core, eval_rows["user_id"].to_numpy(), eval_rows["item_id"].to_numpy(), dev)
    ranking_auc = auc(eval_rows["label"].to_numpy(), scores)
    t = lap("ranking_eval", t)
    # the served forward in each precision this CPU runs, on the same rows: what --ranking-precision auto reads
    precision_rows = eval_rows
    if precision_rows.height > cfg.max_precision_rows:
        precision_rows = precision_rows.sample(cfg.max_precision_rows, seed=cfg.seed)
    # on one thread: the served forward's small ops each wake a sleeping worker, and this pass took
    # 10.7 s at full scale on two threads against 5.2 s on one (BENCHMARKS.md, "Training threads")
    with torch_threads(1):
        auc_by_precision = precision_aucs(dlrm, core, precision_rows)
    # the rows the ranking stage checks each form against fp32 on at load (recpipe.ranking.probe)
    ranking_probe = precision_probe(core, precision_rows)
    t = lap("precision_eval", t)

    out_parent = out.parent if str(out.parent) else Path(".")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out_parent))
    try:
        # each stage writes its own artifacts (recpipe/<stage>/artifacts.py), and reads them back the same way
        feature_artifacts.save(tmp, prep, core.config)
        feature_artifacts.save_rows(tmp, *core.rows())
        retrieval_artifacts.save(tmp, two_tower, item_emb, index, spec, tried)
        ranking_artifacts.save(tmp, dlrm)
        ranking_probes.save(tmp, ranking_probe)
        timings["total"] = round(time.perf_counter() - t_start, 3)
        oracle = data_manifest.get("oracle") or {}
        content = {
            "dataset_sha256": dataset_sha256(data_manifest),
            "dataset": {"path": str(data_dir), "scale": data_manifest.get("scale"), "seed": data_manifest.get("seed"),
                        "rows": data_manifest.get("rows"), "sha256": data_manifest["sha256"]},
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "versions": _versions(),
            "metrics": {
                "ranking_auc": round(ranking_auc, 5),
                "oracle_auc": oracle.get("auc"),
                "ranking_train_auc": dl_stats["train_auc"],
                "ranking_val_auc": dl_stats["val_auc"],
                "ranking_epoch": dl_stats["epoch"],
                "ranking_epochs_run": dl_stats["epochs_run"],
                "ranking_interaction": dlrm.config.interaction,
                "ranking_auc_by_precision": auc_by_precision,
                "oracle_recall_at_500": oracle.get("recall_at_500"),
                "retrieval_recall_at_500": round(retrieval_recall, 5),
                "popularity_recall_at_500": round(popularity_recall, 5),
                "index_recall_at_100": round(index_recall, 5),
                "index_recall_at_500": round(index_recall_500, 5),
                "index_type": spec.kind,
                "eval_users": len(eval_users),
                "eval_pairs": int(pairs.height),
                "eval_rows": int(eval_rows.height),
                "precision_eval_rows": int(precision_rows.height),
            },
            "shapes": {
                "num_users": core.num_users, "num_items": core.num_items,
                "user_dense_dim": core.user_dense_dim, "item_dense_dim": core.item_dense_dim,
                "item_base_dim": core.item_base_dim, "user_sparse_dim": int(core.user_sparse.shape[1]),
                "item_sparse_dim": int(core.item_sparse.shape[1]), "history_len": core.history_len,
                "embedding_dim": int(item_emb.shape[1]),
            },
            "index": {**spec.to_json(), "tried": [s.to_json() for s in tried]},
            "training": {
                "device": devices.describe(dev), "torch_threads": torch.get_num_threads(),
                "omp_wait_policy": threads.wait_policy(),
                "seconds": timings, "config": {
                    k: v for k, v in cfg.__dict__.items() if k != "progress"},
                "two_tower": tt_stats, "dlrm": dl_stats,
                "train_rows": train_df.height, "holdout_rows": holdout.height,
            },
        }
        manifest = write_manifest(tmp, content)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
