"""Held-out AUC of the served ranking forward in each precision the CPU runs (``recpipe.ranking.precision``).

The rows are scored the way ``RankingCore`` scores a request: grouped by user, through the
factorised forward (``Predictor.score_batch``), on a CPU copy of the model (bf16 eagerly: the served
form is the same computation compiled, equal up to rounding, and compiling would add to training time).
Several users share a forward: fp32 and bf16 give each row the same score whatever its batch-mates
(up to rounding). int8 scales each forward's activations over that forward's rows, and a served
request is one user with ``DEFAULT_NUM_CANDIDATES`` candidates; a held-out user has a few rows, so
int8's forwards take whole users up to that many rows (``chunk_rows``), as the ranking stage's probe
does (``recpipe.ranking.probe.scores``); one forward per held-out user would scale over a few rows
each, and made this pass 12x slower. ``--ranking-precision auto`` reads these numbers from the
manifest (``metrics.ranking_auc_by_precision``).
"""

from __future__ import annotations

import copy

import numpy as np
import polars as pl
import torch

from recpipe.config import DEFAULT_NUM_CANDIDATES
from recpipe.features.core import FeatureCore
from recpipe.ranking import precision
from recpipe.ranking.model import DLRM
from recpipe.ranking.predictor import Predictor
from recpipe.ranking.probe import PROBE_ROWS, Probe, user_runs
from recpipe.training.metrics import auc

#: candidates per forward at most (users are never split across forwards)
CHUNK_ROWS = 4096


def chunk_rows(form: str) -> int:
    """Rows per forward for ``form``: a served request's candidates where the form scales activations per
    call (int8), else ``CHUNK_ROWS``."""
    return DEFAULT_NUM_CANDIDATES if form == "int8" else CHUNK_ROWS


def served_scores(predictor: Predictor, core: FeatureCore, users: np.ndarray, items: np.ndarray,
                  max_rows: int = CHUNK_ROWS) -> np.ndarray:
    """(n,) probabilities for (user, item) rows sorted by user, one forward per chunk of whole users of
    at most ``max_rows`` rows (one user with more is a chunk of its own)."""
    out: list[np.ndarray] = []
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]]) if len(users) else np.zeros(0, np.int64)
    bounds = np.r_[starts, len(users)]
    for first, last in user_runs(np.diff(bounds), max_rows):
        lo, hi = bounds[first], bounds[last]
        u = users[starts[first:last]]
        out.append(predictor.score_batch(core.user_dense_rows(u), core.user_sparse[u],
                                         core.item_dense_rows(users[lo:hi], items[lo:hi]), core.item_sparse[items[lo:hi]],
                                         np.diff(bounds[first : last + 1]).tolist(), one_forward=True))
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def precision_aucs(model: DLRM, core: FeatureCore, rows: pl.DataFrame) -> dict[str, float]:
    """{form: held-out AUC} for every form this CPU can run (fp32 first), on ``rows`` (user_id, item_id, label)."""
    rows = rows.sort("user_id", maintain_order=True)
    users, items, labels = (rows[c].to_numpy() for c in ("user_id", "item_id", "label"))
    cpu_model = copy.deepcopy(model).cpu().eval()
    result: dict[str, float] = {}
    for form in precision.available(torch.device("cpu")):
        predictor = Predictor(cpu_model, torch.device("cpu"), precision=form, compile=False)
        predictor.set_user_tables(int(core.user_sparse.shape[1]))
        result[form] = round(auc(labels, served_scores(predictor, core, users, items, chunk_rows(form))), 5)
    return result


def probe(core: FeatureCore, rows: pl.DataFrame, max_rows: int = PROBE_ROWS) -> Probe:
    """The ranking stage's probe (``recpipe.ranking.probe``): whole users of ``rows`` (user_id, item_id,
    label; held-out), in user order, up to ``max_rows`` rows, as the stage sees them."""
    rows = rows.sort("user_id", maintain_order=True)
    users, items, labels = (rows[c].to_numpy() for c in ("user_id", "item_id", "label"))
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]]) if len(users) else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], len(users)].astype(np.int64)
    keep = int(np.searchsorted(ends, max_rows, side="right"))  # whole users while they fit
    n = int(ends[keep - 1]) if keep else 0
    u = users[starts[:keep]]
    return Probe(core.user_dense_rows(u), core.user_sparse[u], core.item_dense_rows(users[:n], items[:n]),
                 core.item_sparse[items[:n]], (ends[:keep] - starts[:keep]).astype(np.int64),
                 labels[:n].astype(np.float32), f"{n:,} held-out rows of {keep:,} users")
