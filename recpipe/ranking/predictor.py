"""Scores candidates with a trained DLRM under ``eval()`` + ``torch.inference_mode()``.

``score_candidates`` and ``score_batch`` run the factorised forward (``recpipe.ranking.factorised``):
a user's own work once per request, the rest per candidate; it equals ``model(dense, sparse)`` up to
float rounding at about half the cost.

``score_batch`` on a CUDA device replays a CUDA graph per bucketed (users, candidates) shape
(``recpipe.accel.cuda_graphs``): the inputs are padded with zeros up to the bucket in pinned host buffers,
copied asynchronously on the stage's stream, and the answer is sliced back. Padded candidates belong
to user 0 and padded users have no candidates, so the real rows' scores do not change. The CPU runs
the same padding eagerly in ``padded`` mode (what the tests compare with the unpadded answer) and no
padding at all by default.

A compiled or captured forward never compiles on the request path. It serves a fixed set of shape
buckets (``row_buckets`` x ``user_buckets``: candidates padded up to the next power of two from
``MIN_ROWS_BUCKET`` to ``MAX_ROWS``, in the compiled CPU form every ``ROWS_STEP`` above it, users to
the next power of two up to the core's batch), and
``warm_buckets`` runs every one of them before the stage reports SERVING: the compiled bf16 form
(``torch.compile`` with dynamic shapes; on the CPU the segmented form of ``recpipe.ranking.segmented``,
two compiled parts around one matmul per user, at least 2 users) and CUDA graphs (one capture per
bucket). A forward with a shape that was not warmed runs the same module eagerly (the segmented form
first splits a batch of more users than warmed for into warmed pieces). The core splits a request with
more than ``MAX_ROWS`` candidates into forwards of at most ``MAX_ROWS``, so every candidate count up to
the contract's 10,000 has a bucket.
A compile on the request path would hold the stage for seconds (a new candidate count recompiled the
dynamic-shape graph: 231 ms in process, over 3 s served on a busy machine).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from recpipe.accel.cuda_graphs import GraphRunner, bucket
from recpipe.accel.transfer import DeviceIO
from recpipe.ranking import precision as precisions
from recpipe.ranking.factorised import user_split
from recpipe.ranking.model import DLRM
from recpipe.ranking.segmented import SegmentedForward, supports_segments

_log = logging.getLogger(__name__)

#: Candidate-count buckets start here: fewer rows than this cost a GPU no more than this many.
MIN_ROWS_BUCKET = 64
#: Candidates per forward at most (the largest bucket): the core splits larger requests, and a batch of
#: requests runs as forwards of at most this many candidates. It also bounds the working set: one
#: forward over 32 x 500 candidates would hold ~150 MB of intermediates and leave the process that
#: much larger for good.
MAX_ROWS = 4096
#: Users (requests) per forward at most: the largest user bucket (the GPU batcher's default batch).
MAX_USERS = 32


#: The compiled CPU form's buckets above this many candidates step by this many (512, 1024, 1536, ...),
#: not by powers of two: its time grows with the padded rows, and a batch of 5 or 6 requests of 500
#: candidates padded to 4096 took 3.3-3.9 ms against 2.4-2.7 unpadded (bf16, segmented, 2-core
#: AVX512-BF16 EPYC; one compiled call per shape, so more buckets cost nothing at the request and
#: 0.05 s more at load). CUDA graphs keep powers of two: a capture per bucket, and padded rows cost a
#: GPU little.
ROWS_STEP = 512


def row_buckets(step: int = 0) -> list[int]:
    """The candidate counts a padded forward runs at: 64, 128, ..., ``MAX_ROWS`` (powers of two), or with
    ``step`` powers of two up to ``step`` and then every ``step`` (64, ..., 512, 1024, 1536, ...)."""
    out, n = [], bucket(MIN_ROWS_BUCKET)
    while n <= MAX_ROWS:
        out.append(n)
        n = n + step if step and n >= step else n * 2
    return out


def bucket_rows(rows: int, step: int = 0) -> int:
    """The bucket of ``row_buckets(step)`` a forward of ``rows`` candidates runs at (the next one up)."""
    padded = bucket(rows, MIN_ROWS_BUCKET)
    return -(-rows // step) * step if step and padded > step else padded


def user_buckets(max_users: int) -> list[int]:
    """The user counts a padded forward runs at for batches of up to ``max_users`` requests: 1, 2, 4, ..."""
    top = bucket(min(max(1, max_users), MAX_USERS))
    return [1 << i for i in range(top.bit_length())]


class Predictor:
    """``graphs``: ``eager`` (no padding; the CPU default), ``padded`` (bucketed shapes run eagerly: the
    CPU twin of graphs, or CUDA with graphs off) or ``graph`` (CUDA graph replay per bucket). A compiled
    form (bf16 on the CPU) runs padded whatever ``graphs`` says: it serves the buckets it was warmed for."""

    def __init__(self, model: DLRM, device: torch.device, graphs: str = "eager", precision: str = "fp32",
                 compile: bool = True, full_gram: bool = False) -> None:
        """``precision``: the form the factorised forward runs in (``recpipe.ranking.precision.FORMS``);
        ``predict`` and the unfactorised path stay fp32. ``compile`` False keeps bf16 eager (the same
        numbers up to rounding, without the compilation: what ``recpipe train`` measures AUC with).
        ``full_gram``: the item x item part over the full Gram matrix even where the CPU takes the
        triangle (``gram_pairs``): what ``recpipe bench ranking`` times the compiled form against."""
        if precision not in precisions.FORMS:
            raise ValueError(f"precision must be one of {precisions.FORMS}, got {precision!r}")
        self.model = model.to(device).eval()
        self.device = device
        self.graphs = graphs
        self.precision = precision
        #: whether the forward runs compiled (``torch.compile``: the bf16 form, where it compiles)
        self.compiled = False
        self._compile = compile
        self._full_gram = full_gram
        self.io = DeviceIO(device)
        self.num_user_tables = 0
        self._split: nn.Module | None = None
        self._runner: GraphRunner | None = None
        #: the same forward run eagerly (padded), for shapes not warmed once ``sealed``: a compiled form
        #: or CUDA graphs (None where nothing compiles or captures)
        self._unwarmed: GraphRunner | None = None
        #: the (users, rows) buckets run so far by ``warm_up``, and what ``warm_buckets`` took
        self.warmed: set[tuple[int, int]] = set()
        self.warm_s = 0.0
        self.warm_runs = 0
        #: set by ``warm_buckets``: from then on a shape that was not warmed runs eagerly (never compiled
        #: or captured on the request path), counted in ``unwarmed_forwards``
        self.sealed = False
        self.unwarmed_forwards = 0
        #: the compiled CPU form of the dot interaction (``recpipe.ranking.segmented``; its parts run eagerly
        #: for shapes not warmed); None elsewhere
        self._segmented: SegmentedForward | None = None
        #: ``row_buckets``' step: ``ROWS_STEP`` for a compiled CPU form, 0 (powers of two) elsewhere
        self.row_step = 0

    @property
    def mode(self) -> str:
        """How the forward runs: ``graph``, ``padded`` or ``eager`` (see ``recpipe.accel.cuda_graphs``)."""
        return self._runner.mode if self._runner is not None else self.graphs

    def set_user_tables(self, num_user_tables: int) -> None:
        """Enable the factorised path: the first ``num_user_tables`` sparse features belong to the user.
        A compiled form is compiled here for one user (its smallest bucket); ``warm_buckets`` does the rest."""
        self.num_user_tables = num_user_tables
        split = user_split(self.model, num_user_tables).to(self.device)
        compile = self.precision == "bf16" and self._compile
        if compile:
            try:
                self._build(split, compiled=True)
                self.warm_up([1])  # compile now, not at the first request
            except Exception as e:  # any compiler failure (no C++ compiler, ...): the eager form works
                _log.warning("torch.compile of the bf16 ranking forward failed (%s); running it eagerly",
                             str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                self.warmed.clear()
            else:
                self.compiled = True
                return
        self._build(split, compiled=False)

    def _build(self, split: nn.Module, compiled: bool) -> None:
        mode = "padded" if compiled and self.graphs == "eager" else self.graphs
        self.row_step = ROWS_STEP if compiled and self.device.type == "cpu" else 0
        split.gather_segments = mode != "eager" or self.device.type != "cpu"  # type: ignore[assignment]
        segmented = compiled and self.device.type == "cpu" and supports_segments(split)
        if hasattr(split, "gram_pairs"):  # the dot interaction's: the triangle where the CPU runs unpadded or
            # segmented (segmented bf16 at 8 x 500: 4-6% less per request than the full matrix; a lone request
            # the same within noise); the padded CPU twin of CUDA graphs keeps CUDA's layout
            on_cpu = (mode == "eager" and self.device.type == "cpu") or segmented
            split.gram_pairs = on_cpu and not self._full_gram  # type: ignore[assignment]
        self._segmented = None
        if segmented:
            low = precisions.convert(split, self.precision, compile=False).eval()
            self._split = low
            self._runner = GraphRunner(_probabilities(low), self.device, mode)  # what GetInfo and warming read
            self._segmented = SegmentedForward(low, self.io)
            return
        run = precisions.convert(split, self.precision, compile=compiled).eval()
        self._split = run
        self._runner = GraphRunner(_probabilities(run), self.device, mode)
        eager: nn.Module | None = getattr(run, "_orig_mod", None) if compiled else run if mode == "graph" else None
        self._unwarmed = None if eager is None else GraphRunner(_probabilities(eager), self.device, "padded")

    def warm_buckets(self, max_users: int = 1) -> int:
        """Run every bucketed shape a forward can take for batches of up to ``max_users`` requests once,
        so that nothing compiles (``torch.compile``) or is captured (CUDA graphs) on the request path;
        returns the number of shapes run. An eager forward runs the same sizes once too (unpadded, they
        are not all the sizes it will see): its first calls grow the heap and set up the kernels, which
        made a fresh stage's first 500-candidate call 2-3x its second."""
        runner = self._runner
        if runner is None:
            raise RuntimeError("warm_buckets needs set_user_tables() first")
        t0 = time.perf_counter()
        user_counts = [1] if self.per_user else sorted({self._bucketed(u, 1)[0] for u in user_buckets(max_users)})
        shapes = [(u, r) for u in user_counts for r in row_buckets(self.row_step) if (u, r) not in self.warmed]
        for users, rows in shapes:
            self.warm_up([rows - users + 1] + [1] * (users - 1))
        self.sealed = runner.padded
        self.warm_s += time.perf_counter() - t0
        self.warm_runs = len(shapes)
        return len(shapes)

    @property
    def graphs_captured(self) -> int:
        return self._runner.captured if self._runner is not None else 0

    def _t(self, a: np.ndarray, dtype: type) -> torch.Tensor:
        arr: np.ndarray = np.ascontiguousarray(a, dtype=dtype)
        if not arr.flags.writeable:  # torch warns on read-only buffers (e.g. decoded from a message)
            arr = arr.copy()
        return torch.from_numpy(arr).to(self.device)

    def predict(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        """dense (B, Dd) float32 + sparse (B, F) int64 -> (B,) float32 click probabilities."""
        with torch.inference_mode():
            logits = self.model(self._t(dense, np.float32), self._t(sparse, np.int64))
            return torch.sigmoid(logits).float().cpu().numpy()

    def score_candidates(
        self, user_dense: np.ndarray, user_sparse: np.ndarray, item_dense: np.ndarray, item_sparse: np.ndarray,
        factorized: bool = True,
    ) -> np.ndarray:
        """(Du,), (U,), (k, Di), (k, I) -> (k,) float32 probabilities."""
        k = item_dense.shape[0]
        if k == 0:
            return np.zeros(0, np.float32)
        if factorized and self._split is not None:
            return self.score_batch(user_dense[None, :], user_sparse[None, :], item_dense, item_sparse, [k])
        with torch.inference_mode():
            ud, us = self._t(user_dense, np.float32), self._t(user_sparse, np.int64)
            dense = torch.cat([ud.expand(k, -1), self._t(item_dense, np.float32)], dim=1)
            sparse = torch.cat([us.expand(k, -1), self._t(item_sparse, np.int64)], dim=1)
            return torch.sigmoid(self.model(dense, sparse)).float().cpu().numpy()

    def score_batch(
        self, user_dense: np.ndarray, user_sparse: np.ndarray, item_dense: np.ndarray, item_sparse: np.ndarray,
        counts: list[int], one_forward: bool = False,
    ) -> np.ndarray:
        """B users' candidates in one forward: (B, Du), (B, U), (N, Di), (N, I) with N = sum(counts),
        the first counts[0] items belonging to user 0 and so on -> (N,) float32 probabilities.
        ``one_forward``: one forward even where serving runs one per user (``per_user``): int8 then
        scales its activations over every user's rows, as a request's size of held-out rows wants them
        (``recpipe.ranking.probe.scores``, ``recpipe train``'s precision AUC)."""
        runner = self._runner
        if runner is None:
            raise RuntimeError("score_batch needs set_user_tables() first")
        b, n = len(counts), int(sum(counts))
        if b > 1 and self.per_user and not one_forward:
            return self._score_per_user(user_dense, user_sparse, item_dense, item_sparse, counts)
        users, rows = self._bucketed(b, n) if runner.padded else (b, n)
        unwarmed = self.sealed and (users, rows) not in self.warmed
        if self._segmented is not None:
            if unwarmed and b > 1:  # more users or rows than warmed for: halves (the same rows, so the same scores)
                h, cut = b // 2, int(sum(counts[: b // 2]))
                return np.concatenate([
                    self.score_batch(user_dense[:h], user_sparse[:h], item_dense[:cut], item_sparse[:cut], counts[:h]),
                    self.score_batch(user_dense[h:], user_sparse[h:], item_dense[cut:], item_sparse[cut:], counts[h:])])
            if unwarmed:
                self.unwarmed_forwards += 1  # one user's rows beyond the largest bucket: eagerly
            return self._segmented(user_dense, user_sparse, item_dense, item_sparse, counts, users, rows,
                                   compiled=not unwarmed)
        if unwarmed and self._unwarmed is not None:
            self.unwarmed_forwards += 1  # a shape not warmed: run eagerly, never compiled or captured here
            runner = self._unwarmed
        io = self.io
        with torch.inference_mode(), io.stream():
            inputs = [io.put("user_dense", user_dense, np.float32, users),
                      io.put("user_sparse", user_sparse, np.int64, users),
                      io.put("item_dense", item_dense, np.float32, rows),
                      io.put("item_sparse", item_sparse, np.int64, rows)]
            if users > 1:  # padded candidates belong to user 0
                inputs.append(io.put("segments", np.repeat(np.arange(b, dtype=np.int64), counts), np.int64, rows))
            return io.fetch("scores", runner(*inputs), n)

    def _bucketed(self, users: int, rows: int) -> tuple[int, int]:
        """The padded (users, rows) a forward of ``users`` and ``rows`` runs at. The segmented form runs
        at least 2 users: torch.compile specializes a size of 1, and the one-user graph's code rounded
        some users' wide part differently from the graph for several (the last bit of a score)."""
        return bucket(users, 2 if self._segmented is not None else 1), bucket_rows(rows, self.row_step)

    @property
    def gram_pairs(self) -> bool:
        """Whether the forward takes the item x item dots' upper triangle alone (``factorised._UserSplit.gram_pairs``:
        the eager CPU forms and the compiled segmented one) rather than the full Gram matrix."""
        return bool(getattr(self._split, "gram_pairs", False))

    @property
    def segmented(self) -> bool:
        """Whether a batch runs in the segmented form (``recpipe.ranking.segmented``): the compiled CPU
        form of the dot interaction, one call for every user's and candidate's own terms and one matmul
        per user for the folded ones."""
        return self.compiled and self._segmented is not None

    @property
    def per_user(self) -> bool:
        """Whether a batch of several users runs as one forward per user: a compiled CPU form without the
        segmented one (the DCN interaction's: its one-graph form for several users gathers every item's
        user vectors, the per-candidate work of the user-side terms too), and int8, whose dynamic
        quantization scales each call's activations by the call's own range, so a request's scores would
        move with its batch-mates (by up to 0.02 at 4 x 500)."""
        if self.device.type != "cpu":
            return False
        return (self.compiled and self._segmented is None) or self.precision == "int8"

    def _score_per_user(self, user_dense: np.ndarray, user_sparse: np.ndarray, item_dense: np.ndarray,
                        item_sparse: np.ndarray, counts: list[int]) -> np.ndarray:
        out, start = [], 0
        for i, count in enumerate(counts):
            if count:
                end = start + count
                out.append(self.score_batch(user_dense[i : i + 1], user_sparse[i : i + 1], item_dense[start:end],
                                            item_sparse[start:end], [count]))
                start = end
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def warm_up(self, counts: list[int]) -> None:
        """Run (and compile, or in ``graph`` mode capture) the shape of ``counts`` once, on zeros; a padded
        shape counts as warmed from then on."""
        cfg = self.model.config
        b, n, u = len(counts), int(sum(counts)), self.num_user_tables
        runner = self._runner
        if runner is not None and runner.padded:
            self.warmed.add(self._bucketed(b, n))
        sealed, self.sealed = self.sealed, False  # warming is where compiling and capturing belong
        try:
            self.score_batch(np.zeros((b, cfg.user_dense_dim), np.float32), np.zeros((b, u), np.int64),
                             np.zeros((n, cfg.item_dense_dim), np.float32),
                             np.zeros((n, cfg.num_tables - u), np.int64), counts)
        finally:
            self.sealed = sealed


def _probabilities(run: nn.Module) -> Callable[..., torch.Tensor]:
    """The forward as the runner calls it: (ud, us, idn, isp[, seg]) -> (N,) float32 probabilities."""

    def probabilities(*inputs: torch.Tensor) -> torch.Tensor:
        ud, us, idn, isp, *seg = inputs
        return torch.sigmoid(run(ud, us, idn, isp, seg[0] if seg else None).float())

    return probabilities
