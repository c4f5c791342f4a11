"""The bound a low-precision ranking form keeps against fp32, checked at load on held-out rows.

A served form other than fp32 (bf16 compiled, int8) may move no click probability by more than
``MAX_ABS_DP`` and may lose at most ``precision.AUC_BUDGET`` of held-out AUC against fp32, the
same model on the same rows. ``recpipe train`` keeps a *probe*, up to ``PROBE_ROWS`` held-out rows as
the ranking stage sees them (whole users, with their labels), in ``ranking/probe.safetensors``;
``RankingCore`` scores it at load in fp32 and in every form ``--ranking-precision auto`` may pick, and
``auto`` never picks a form that breaks the bound. A form asked for by name is served, with the
breach in GetInfo and the log. A repository written before probes has none: its forms are checked
on random rows within the model's input ranges (|Δp| only: no labels, so no AUC).

Why both figures: AUC only sees the order of the scores; a form can keep the AUC and still move
single probabilities a lot. int8's dynamic quantization does: every activation tensor gets one
scale, and the pairwise dots fed to the top MLP's first layer span a wide range, so some rows lose
most of their precision. At scale 0.02 it moved one probability by 0.17 (0.22 against fp32's 0.05)
while its AUC fell by only 0.0008; bf16 kept every row within 0.006.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from recpipe.auc import auc
from recpipe.config import DEFAULT_NUM_CANDIDATES
from recpipe.errors import ArtifactMismatch
from recpipe.ranking.contract import RankingLimits
from recpipe.ranking.precision import AUC_BUDGET
from recpipe.repository import Repository

if TYPE_CHECKING:
    from recpipe.ranking.predictor import Predictor

PROBE_FILE = "ranking/probe.safetensors"
#: held-out rows a probe keeps at most (whole users)
PROBE_ROWS = 4096
#: the largest |p_form - p_fp32| a served low-precision form may show on any probe row
MAX_ABS_DP = 0.02
_FIELDS = ("user_dense", "user_sparse", "item_dense", "item_sparse", "counts", "labels")


@dataclass(frozen=True)
class Probe:
    """U users' rows: user_dense (U, Du) float32, user_sparse (U, Fu) int64, item_dense (N, Di) float32,
    item_sparse (N, Fi) int64, counts (U,) int64 summing to N, labels (N,) float32 or None."""

    user_dense: np.ndarray
    user_sparse: np.ndarray
    item_dense: np.ndarray
    item_sparse: np.ndarray
    counts: np.ndarray
    labels: np.ndarray | None
    #: where the rows come from, as GetInfo says it
    source: str

    @property
    def rows(self) -> int:
        return int(self.item_dense.shape[0])

    def users(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]]:
        """One user's (ud (1, Du), us (1, Fu), idn (k, Di), isp (k, Fi), [k]) at a time."""
        start = 0
        for u, k in enumerate(self.counts.tolist()):
            yield (self.user_dense[u : u + 1], self.user_sparse[u : u + 1], self.item_dense[start : start + k],
                   self.item_sparse[start : start + k], [k])
            start += k

    def chunks(self, max_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]]:
        """Runs of whole users of at most ``max_rows`` rows (a user with more is a run of its own), as
        ``users()`` gives one user: (ud (B, Du), us (B, Fu), idn (k, Di), isp (k, Fi), their counts)."""
        bounds = np.r_[0, np.cumsum(self.counts)]
        for first, last in user_runs(self.counts, max_rows):
            lo, hi = int(bounds[first]), int(bounds[last])
            yield (self.user_dense[first:last], self.user_sparse[first:last], self.item_dense[lo:hi],
                   self.item_sparse[lo:hi], self.counts[first:last].tolist())


def user_runs(counts: np.ndarray, max_rows: int) -> Iterator[tuple[int, int]]:
    """[first, last) ranges of consecutive users whose ``counts`` (rows per user) sum to at most
    ``max_rows``, each as long as that allows; a user with more rows is a range of its own."""
    first, rows = 0, 0
    for u, k in enumerate(counts.tolist()):
        if u > first and rows + k > max_rows:
            yield first, u
            first, rows = u, 0
        rows += k
    if first < len(counts):
        yield first, len(counts)


def save(root: Path, probe: Probe) -> None:
    """Write ``probe`` into the repository being built at ``root``."""
    from safetensors.numpy import save_file

    arrays = {name: np.ascontiguousarray(getattr(probe, name)) for name in _FIELDS if getattr(probe, name) is not None}
    (root / "ranking").mkdir(exist_ok=True)
    save_file(arrays, str(root / PROBE_FILE))


def load(repo: Repository, limits: RankingLimits) -> Probe | None:
    """The repository's probe (None if it was written before probes); ``ArtifactMismatch`` if it does not
    fit the model's inputs."""
    if PROBE_FILE not in repo.manifest["files"]:
        return None
    from safetensors.numpy import load_file

    path = repo.file(PROBE_FILE)
    try:
        arrays = load_file(str(path))
    except Exception as e:  # a file safetensors cannot parse
        raise ArtifactMismatch(f"{path}: unreadable ({e})") from None
    missing = [n for n in _FIELDS[:5] if n not in arrays]
    if missing:
        raise ArtifactMismatch(f"{path}: no {', '.join(missing)}")
    ud, us, idn, isp, counts = (arrays[n] for n in _FIELDS[:5])
    labels = arrays.get("labels")
    n, users = idn.shape[0], ud.shape[0]
    if (ud.shape != (users, limits.user_dense_dim) or us.shape != (users, len(limits.user_table_sizes))
            or idn.shape != (n, limits.item_dense_dim) or isp.shape != (n, len(limits.item_table_sizes))
            or counts.shape != (users,) or int(counts.sum()) != n or (labels is not None and labels.shape != (n,))
            or (us >= limits.user_table_sizes).any() or (isp >= limits.item_table_sizes).any()):
        raise ArtifactMismatch(f"{path}: its rows do not fit the DLRM's inputs")
    return Probe(ud.astype(np.float32), us.astype(np.int64), idn.astype(np.float32), isp.astype(np.int64),
                 counts.astype(np.int64), None if labels is None else labels.astype(np.float32),
                 f"{n:,} held-out rows of {users:,} users")


def synthetic(limits: RankingLimits, users: int = 8, per_user: int = 512, seed: int = 0) -> Probe:
    """Random rows within the model's input ranges (standardised dense values, uniform ids): the probe
    of a repository written before probes (no labels)."""
    g = np.random.default_rng(seed)
    n = users * per_user
    return Probe(g.standard_normal((users, limits.user_dense_dim)).astype(np.float32),
                 (g.random((users, len(limits.user_table_sizes))) * limits.user_table_sizes).astype(np.int64),
                 g.standard_normal((n, limits.item_dense_dim)).astype(np.float32),
                 (g.random((n, len(limits.item_table_sizes))) * limits.item_table_sizes).astype(np.int64),
                 np.full(users, per_user, np.int64), None, f"{n:,} random rows (the repository has no probe)")


def scores(predictor: Predictor, probe: Probe) -> np.ndarray:
    """(N,) the probe's probabilities from ``predictor``. A compiled form scores one user per forward
    (the shapes it compiled for). The others take whole users up to a served request's candidates
    (``DEFAULT_NUM_CANDIDATES`` rows) per forward: fp32 gives a row the same score whatever its
    batch-mates (up to rounding), and int8 then scales its activations over as many rows as it does
    serving a request, not over one held-out user's few. One user per forward made the probe 90% of a
    ranking stage's load (2.6-3.3 of 2.8-3.7 s, scale 0.1, 2-core AVX2 VM)."""
    if predictor.compiled:
        return np.concatenate([predictor.score_batch(*user) for user in probe.users()])
    return np.concatenate([predictor.score_batch(*run, one_forward=True)
                           for run in probe.chunks(DEFAULT_NUM_CANDIDATES)])


@dataclass(frozen=True)
class FormCheck:
    """One form against fp32 on a probe: the largest |Δp| and the AUC delta (None without labels)."""

    form: str
    max_abs_dp: float
    auc_delta: float | None
    source: str

    @property
    def ok(self) -> bool:
        return self.max_abs_dp <= MAX_ABS_DP and (self.auc_delta is None or self.auc_delta >= -AUC_BUDGET)

    def describe(self) -> str:
        auc_text = "" if self.auc_delta is None else f", dAUC {self.auc_delta:+.4f}"
        verdict = "within the bound" if self.ok else f"BREAKS the bound (|dp| <= {MAX_ABS_DP:g}, dAUC >= -{AUC_BUDGET:g})"
        return f"max |dp| {self.max_abs_dp:.4f}{auc_text} on {self.source}: {verdict}"


def check(form: str, reference: np.ndarray, got: np.ndarray, probe: Probe) -> FormCheck:
    """``got`` (a form's probe scores) against ``reference`` (fp32's)."""
    dp = float(np.max(np.abs(got.astype(np.float64) - reference))) if len(got) else 0.0
    delta = None
    if probe.labels is not None:
        a, b = auc(probe.labels, got), auc(probe.labels, reference)
        delta = None if np.isnan(a) or np.isnan(b) else a - b
    return FormCheck(form, dp, delta, probe.source)
