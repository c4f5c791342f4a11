"""Training loops for the two-tower and DLRM models, fed by ``FeatureCore`` gathers.

Every batch is built by the same ``FeatureCore`` methods that serve requests, with the rows' own
strictly-earlier history counts (``FeatureCore.training_counts``). On CUDA the loops run under bf16 autocast with TF32
matmuls; on CPU in float32, except the DLRM's training steps on CPUs with native bf16 (``dlrm_autocast``,
``TrainConfig.ranking_bf16``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from recpipe import schema
from recpipe.features.core import FeatureCore
from recpipe.features.history import RowCounts
from recpipe.ranking.model import DLRM, DLRMConfig, SparseArch
from recpipe.retrieval.config import TwoTowerConfig
from recpipe.retrieval.model import TwoTower
from recpipe.training import fixed_tables, heap, tables
from recpipe.training.config import TrainConfig
from recpipe.training.metrics import auc
from recpipe.training.progress import Progress, batches

log = logging.getLogger(__name__)
#: where the cosine learning-rate schedule ends, as a share of the starting rate
FINAL_LR_FACTOR = 0.02


def _step(opts: Sequence[torch.optim.Optimizer], loss: torch.Tensor) -> float:
    """Zero, backpropagate, step every optimiser; returns the loss value."""
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    for opt in opts:
        opt.step()
    return float(loss.detach())


def autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def dlrm_autocast(device: torch.device, bf16: bool | None = None) -> contextlib.AbstractContextManager[object]:
    """The DLRM's training forward: bf16 autocast where ``bf16`` (``TrainConfig.ranking_bf16``) asks
    for it, and by default (None) on CUDA and on CPUs with native bf16 (AMX / AVX512-BF16: steps ~2x
    faster here at the same held-out AUC, see BENCHMARKS.md); else fp32."""
    if bf16 is None:
        from recpipe.ranking.precision import native_bf16

        bf16 = device.type == "cuda" or (device.type == "cpu" and native_bf16())
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def step_batch(rows: int, batch: int, min_steps: int, floor: int = 64) -> int:
    """``batch``, made smaller for small data so an epoch has at least ``min_steps`` steps (not below ``floor``)."""
    return max(2, min(batch, max(floor, rows // max(1, min_steps))))


def _t(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


# ---- two-tower ----------------------------------------------------------------------------------------


def two_tower_config(core: FeatureCore, cfg: TrainConfig) -> TwoTowerConfig:
    p = core.preprocessor
    return TwoTowerConfig(
        user_dense_dim=core.user_dense_dim,
        item_dense_dim=core.item_base_dim,
        user_table_sizes=tuple(p.table_sizes("users")),
        item_table_sizes=tuple(p.table_sizes("items")),
        embedding_dim=cfg.embedding_dim,
        out_dim=cfg.retrieval_dim,
        temperature=cfg.temperature,
    )


def train_two_tower(
    core: FeatureCore, users: np.ndarray, items: np.ndarray, counts: RowCounts, cfg: TrainConfig,
    device: torch.device,
) -> tuple[TwoTower, dict[str, float]]:
    """Train on clicked (user, item) training pairs with in-batch softmax + logQ correction."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    model = TwoTower(two_tower_config(core, cfg)).to(device)
    opts = [torch.optim.Adam(model.parameters(), lr=cfg.retrieval_lr, fused=True)]
    clicks = np.bincount(items, minlength=core.num_items).astype(np.float64)
    log_q = _t(np.log(np.maximum(clicks, 1.0) / max(1.0, clicks.sum())).astype(np.float32), device)
    if len(users) > cfg.max_retrieval_rows:
        keep = np.sort(rng.choice(len(users), cfg.max_retrieval_rows, replace=False))
        users, items, counts = users[keep], items[keep], counts.take(keep)
    n = len(users)
    # in-batch negatives: the batch is also the number of negatives, so keep it from getting tiny
    batch = step_batch(n, cfg.retrieval_batch, cfg.min_steps, floor=512)
    t0 = time.perf_counter()
    loss_value = float("nan")
    model.train()
    with Progress(n * cfg.retrieval_epochs, "two-tower", cfg.progress) as bar:
        for _ in range(cfg.retrieval_epochs):
            for idx in batches(n, batch, rng):
                if len(idx) < 2:
                    continue
                u, i, c = users[idx], items[idx], counts.take(idx)
                ud = _t(core.user_dense_rows(u, c), device)
                us = _t(core.user_sparse[u], device)
                idn = _t(core.item_base_rows(i, c), device)
                isp = _t(core.item_sparse[i], device)
                iid = _t(i, device)
                with autocast(device):
                    ue = model.user_tower(ud, us)
                    ie = model.item_tower(idn, isp)
                    loss = model.in_batch_loss(ue.float(), ie.float(), iid, log_q[iid])
                loss_value = _step(opts, loss)
                bar.update(len(idx), loss_value)
    seconds = time.perf_counter() - t0
    model.eval()
    return model, {"loss": loss_value, "seconds": seconds, "rows_per_s": n * cfg.retrieval_epochs / max(seconds, 1e-9)}


def embed_items(model: TwoTower, core: FeatureCore, device: torch.device, batch: int = 16384) -> np.ndarray:
    """(num_items, D) float32 item embeddings (serving features)."""
    out = []
    with torch.inference_mode():
        for start in range(0, core.num_items, batch):
            ids = np.arange(start, min(core.num_items, start + batch))
            with autocast(device):
                e = model.item_tower(_t(core.item_base_rows(ids), device), _t(core.item_sparse[ids], device))
            out.append(F.normalize(e.float(), dim=-1).cpu().numpy())
    return np.concatenate(out).astype(np.float32)


def embed_users(model: TwoTower, core: FeatureCore, user_ids: np.ndarray, device: torch.device,
                batch: int = 16384) -> np.ndarray:
    """(n, D) float32 user (query) embeddings (serving features)."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(user_ids), batch):
            ids = user_ids[start : start + batch]
            with autocast(device):
                e = model.user_tower(_t(core.user_dense_rows(ids), device), _t(core.user_sparse[ids], device))
            out.append(F.normalize(e.float(), dim=-1).cpu().numpy())
    return np.concatenate(out).astype(np.float32) if out else np.zeros((0, model.config.out_dim), np.float32)


# ---- DLRM -----------------------------------------------------------------------------------------------


def signal_columns(core: FeatureCore, table: str) -> tuple[int, int] | None:
    """[start, stop) of ``table``'s dense columns that the schema calls latent signals (the user's taste
    and the item's quality signals, where the data puts what the user-item affinity is made of), or
    None when there are none or they are not one run."""
    spec = schema.USERS if table == "users" else schema.ITEMS
    at = [k for k, name in enumerate(core.preprocessor.dense_names(table))
          if spec.column(name).meaning.startswith("latent")]
    if not at or at[-1] - at[0] + 1 != len(at):
        return None
    return at[0], at[-1] + 1


def dlrm_config(core: FeatureCore, cfg: TrainConfig) -> DLRMConfig:
    p = core.preprocessor
    names = p.sparse_names("users") + p.sparse_names("items")
    # the wide part weighs the products of the user's and the item's signal columns, and of the user's
    # with the leaf category's vector (the table started from exposure, ``tables.EXPOSURE_COLUMN``)
    user_cols, item_cols = signal_columns(core, "users"), signal_columns(core, "items")
    wide = cfg.ranking_wide and tables.EXPOSURE_COLUMN in names and user_cols is not None and item_cols is not None
    return DLRMConfig(
        user_dense_dim=core.user_dense_dim,
        item_dense_dim=core.item_dense_dim,
        table_sizes=tuple(p.table_sizes("users")) + tuple(p.table_sizes("items")),
        embedding_dim=cfg.embedding_dim,
        bottom_dims=cfg.ranking_bottom_dims,
        interaction=cfg.interaction,
        wide_table=names.index(tables.EXPOSURE_COLUMN) if wide else None,
        wide_user_columns=user_cols if wide and user_cols else (0, 0),
        wide_item_columns=item_cols if wide and item_cols else (0, 0),
    )


def ranking_batch(
    core: FeatureCore, users: np.ndarray, items: np.ndarray, counts: RowCounts | None
) -> tuple[np.ndarray, np.ndarray]:
    """DLRM inputs for paired rows: dense (n, Du + Di) float32, sparse (n, 44 + 16) int64.

    ``counts`` given -> training examples' strictly-earlier history; None -> serving features.
    """
    dense = np.concatenate([core.user_dense_rows(users, counts), core.item_dense_rows(users, items, counts)], 1)
    sparse = np.concatenate([core.user_sparse[users], core.item_sparse[items]], 1)
    return dense, sparse


def sample_ranking_rows(labels: np.ndarray, cfg: TrainConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(row indices, per-row loss weights): every positive, and negatives up to ``negatives_per_positive``
    each and to the ``max_ranking_rows`` cap, up-weighted to stand for all of them. Under the cap the
    negatives give way first; positives are subsampled only when they alone exceed it."""
    pos = np.flatnonzero(labels == 1)
    neg = np.flatnonzero(labels != 1)
    if len(pos) > cfg.max_ranking_rows:
        pos = rng.choice(pos, cfg.max_ranking_rows, replace=False)
    room = min(cfg.max_ranking_rows - len(pos), cfg.negatives_per_positive * max(1, len(pos)))
    keep: float = 1.0 if len(neg) == 0 else min(1.0, room / len(neg))
    neg = rng.choice(neg, round(len(neg) * keep), replace=False) if keep < 1.0 else neg
    rows = np.concatenate([pos, neg])
    pos_weight = len(pos) / max(1, int(np.count_nonzero(labels == 1)))
    weights = np.concatenate([np.full(len(pos), 1.0), np.full(len(neg), pos_weight / max(keep, 1e-9))])
    return rows, weights.astype(np.float32)


def _split_params(model: DLRM) -> tuple[list[nn.Parameter], ...]:
    """(bottom-MLP parameters, the other MLP parameters, embedding-table parameters, the wide part's)."""
    bottom = {id(p) for arch in (model.user_dense_arch, model.item_dense_arch) for p in arch.parameters()}
    tables_ = {id(p) for p in model.sparse_arch.parameters()}
    wide = set() if model.wide is None else {id(p) for p in model.wide.parameters()}
    params = list(model.parameters())
    return ([p for p in params if id(p) in bottom], [p for p in params if id(p) not in bottom | tables_ | wide],
            [p for p in params if id(p) in tables_], [p for p in params if id(p) in wide])


def lr_schedule(opt: torch.optim.Optimizer, kind: str, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Per-step learning-rate factor over the ``steps`` planned: ``constant``, or ``cosine`` from 1 to
    ``FINAL_LR_FACTOR``. Adam at a constant rate stops at a noise floor: in a logistic regression on the
    same rows the decay was worth 0.02 held-out AUC, in the DLRM +0.0003 (BENCHMARKS.md, issue 23)."""
    if kind == "constant":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    total = max(1, steps)

    def cosine(step: int) -> float:
        t = min(step, total) / total
        return FINAL_LR_FACTOR + (1.0 - FINAL_LR_FACTOR) * 0.5 * (1.0 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(opt, cosine)


def train_dlrm(
    core: FeatureCore, users: np.ndarray, items: np.ndarray, labels: np.ndarray, counts: RowCounts,
    cfg: TrainConfig, device: torch.device,
) -> tuple[DLRM, dict[str, Any]]:
    """Train on the training rows in time order, less the latest ``cfg.val_fraction`` of them,
    which choose the epoch. Each epoch takes every positive and a sample of the negatives
    (``sample_ranking_rows``); where the row cap leaves rows out, each epoch draws its own
    (``cfg.ranking_fresh_negatives``). With validation rows, training stops after the first epoch that
    does not raise their AUC, and the best epoch's weights are kept. With none, every planned epoch
    runs and the last is kept (its validation AUCs are None). Returns the model and its stats
    (per-epoch AUCs included)."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed + 1)
    model = DLRM(dlrm_config(core, cfg)).to(device)
    n_val = int(len(labels) * cfg.val_fraction)
    fit = len(labels) - n_val
    rows, weights = sample_ranking_rows(labels[:fit], cfg, rng)
    # the tables' start (recpipe/training/tables.py): exposure vectors for the leaf category, zeros
    # that stay zero for the tables too sparse to learn
    names = core.preprocessor.sparse_names("users") + core.preprocessor.sparse_names("items")
    assert isinstance(model.sparse_arch, SparseArch)  # training builds the fused form
    fused = model.sparse_arch.tables
    frozen = tables.sparse_tables(model.config.table_sizes, len(rows), cfg.ranking_min_rows_per_id)
    frozen_names = [names[t] for t in frozen]
    # a leaf table too sparse itself is zeroed like the others, so it is not started from exposure
    exposed = tables.exposure_init(fused.weight, core, names, fused.offsets.tolist(), users[:fit], items[:fit]) \
        if cfg.ranking_exposure_init and tables.EXPOSURE_COLUMN not in frozen_names else None
    # tables that do not learn (rate 0) take no gradient; with the dot interaction the step then skips
    # every table-table dot's backward (recpipe/training/fixed_tables.py)
    fixed = cfg.ranking_embedding_lr == 0
    mask = tables.row_mask(model.config.table_sizes, frozen) if frozen else None
    hook = None if mask is None else tables.zero_rows(fused.weight, mask, keep=not fixed)
    bottom_params, other_params, table_params, wide_params = _split_params(model)
    groups: list[dict[str, Any]] = [{"params": other_params},
                                    {"params": bottom_params, "lr": cfg.ranking_bottom_lr}]
    if wide_params:
        groups.append({"params": wide_params, "lr": cfg.ranking_wide_lr})
    if fixed:
        for p in table_params:
            p.requires_grad_(False)
    else:
        groups.append({"params": table_params, "lr": cfg.ranking_embedding_lr})
    forward = fixed_tables.FixedTableForward(model) if fixed and fixed_tables.applies(model) else model
    opts = [torch.optim.Adam(groups, lr=cfg.ranking_lr, fused=True)]
    epochs = max(1, min(cfg.ranking_epochs, cfg.ranking_row_budget // max(1, len(rows))))
    val = np.arange(fit, len(labels))
    if len(val) > cfg.max_val_rows:
        val = np.sort(rng.choice(val, cfg.max_val_rows, replace=False))
    train_check = np.sort(rng.choice(fit, min(fit, cfg.max_val_rows // 2), replace=False))

    def rows_auc(idx: np.ndarray) -> float:
        scores = score_dlrm(model, core, users[idx], items[idx], device, counts=counts.take(idx))
        return auc(labels[idx], scores)

    seen = np.zeros(fit, dtype=bool)  # the training rows any epoch used
    seen[rows] = True
    batch = step_batch(len(rows), cfg.ranking_batch, cfg.min_steps)
    schedule = lr_schedule(opts[0], cfg.ranking_lr_schedule, epochs * -(-len(rows) // batch))
    history: list[dict[str, float | None]] = []
    best: dict[str, torch.Tensor] | None = None
    best_epoch, best_val = 0, -np.inf
    loss_value = float("nan")
    fit_s = check_s = 0.0
    # large freed blocks stay in the heap for the next step (recpipe/training/heap.py): CPU only
    with Progress(len(rows) * epochs, "dlrm", cfg.progress) as bar, heap.kept_heap(device.type == "cpu"):
        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            if epoch > 1 and cfg.ranking_fresh_negatives and len(rows) < fit:  # a new draw of what the cap left out
                rows, weights = sample_ranking_rows(labels[:fit], cfg, rng)
                seen[rows] = True
            model.train()
            for idx in batches(len(rows), batch, rng):
                r = rows[idx]
                dense, sparse = ranking_batch(core, users[r], items[r], counts.take(r))
                y = _t(labels[r].astype(np.float32), device)
                w = _t(weights[idx], device)
                with dlrm_autocast(device, cfg.ranking_bf16):
                    logits = forward(_t(dense, device), _t(sparse, device))
                loss = (F.binary_cross_entropy_with_logits(logits.float(), y, reduction="none") * w).sum() / w.sum()
                loss_value = _step(opts, loss)
                schedule.step()
                bar.update(len(idx), loss_value)
            t1 = time.perf_counter()
            model.eval()
            val_auc = rows_auc(val) if len(val) else None
            history.append({"epoch": epoch, "loss": round(loss_value, 5), "train_auc": round(rows_auc(train_check), 5),
                            "val_auc": None if val_auc is None else round(val_auc, 5), "seconds": round(t1 - t0, 3)})
            fit_s += t1 - t0
            check_s += time.perf_counter() - t1
            if val_auc is None:  # no validation rows: every planned epoch runs and the last is kept
                best_epoch = epoch
            elif val_auc > best_val:
                best_epoch, best_val = epoch, val_auc
                best = {k: v.detach().clone() for k, v in model.state_dict().items()}
            elif epoch > best_epoch:  # no better than the best: later epochs only memorise more
                break
    if hook is not None:
        hook.remove()
    for p in table_params:
        p.requires_grad_(True)
    if best is not None:
        model.load_state_dict(best)
    model.eval()
    chosen = history[best_epoch - 1]
    n = len(rows) * len(history)
    return model, {
        "loss": loss_value, "seconds": fit_s + check_s, "fit_seconds": round(fit_s, 3),
        "validation_seconds": round(check_s, 3), "rows": float(n), "rows_distinct": int(seen.sum()),
        "rows_per_s": n / max(fit_s, 1e-9),
        "epoch": best_epoch, "epochs_run": len(history), "epochs_max": epochs,
        "train_auc": chosen["train_auc"], "val_auc": chosen["val_auc"], "val_rows": len(val),
        "frozen_tables": frozen_names, "exposure_table": exposed, "tables_learn": not fixed,
        "wide_table": None if model.config.wide_table is None else names[model.config.wide_table],
        "history": history,
    }


def score_dlrm(model: DLRM, core: FeatureCore, users: np.ndarray, items: np.ndarray, device: torch.device,
               batch: int = 8192, counts: RowCounts | None = None) -> np.ndarray:
    """(n,) click probabilities: with serving features (``counts`` None: held-out rows are not in the
    counts), or with training rows' own strictly-earlier ``counts``."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(users), batch):
            part = None if counts is None else counts.take(np.arange(start, min(len(users), start + batch)))
            dense, sparse = ranking_batch(core, users[start : start + batch], items[start : start + batch], part)
            with autocast(device):
                logits = model(_t(dense, device), _t(sparse, device))
            out.append(torch.sigmoid(logits.float()).cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0, np.float32)
