"""The ranking core: DLRM click probabilities for one user's k candidate items.

On a CUDA device the forward replays a CUDA graph per bucketed batch shape (``cuda_graphs``) and the
embedding tables may stay in pinned host memory, read by the GPU in place (``embeddings="host"``).
Loading picks the precision (``recpipe.ranking.precision``; each candidate form checked against fp32
on the repository's probe rows, ``recpipe.ranking.probe``) and then warms every bucketed shape a
compiled or captured forward serves, so nothing compiles on the request path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from recpipe.accel import device as devices
from recpipe.accel import traffic
from recpipe.accel.cuda_graphs import mode_for
from recpipe.accel.transfer import host_mapped
from recpipe.config import DEFAULT_NUM_CANDIDATES
from recpipe.errors import ArtifactMismatch, UsageError
from recpipe.ranking import artifacts
from recpipe.ranking import precision as precisions
from recpipe.ranking import probe as probes
from recpipe.ranking.contract import RankingLimits, RankQuery
from recpipe.ranking.model import DLRMConfig, SparseArch
from recpipe.ranking.options import RankingOptions
from recpipe.ranking.predictor import MAX_ROWS, MAX_USERS, Predictor
from recpipe.repository import Repository
from recpipe.types import ItemFeatures, UserFeatures

_log = logging.getLogger(__name__)

#: Candidates per DLRM forward at most: a batch runs as forwards of at most this many, and a request with
#: more is split (each forward's shape then has a bucket, warmed at load).
CHUNK_ROWS = MAX_ROWS
#: Requests per DLRM forward at most.
CHUNK_USERS = MAX_USERS
#: Requests per forward of the segmented CPU form (``recpipe.ranking.segmented``) when the stage's
#: ``--max-batch`` is auto: its fixed cost per forward (~300 µs) shared by up to 8 users, and 8 x 500
#: candidates still in one row bucket (4,096).
SEGMENT_USERS = 8


class RankingCore:
    """``rank(user, items)`` -> (k,) float32 click probabilities, in the order of ``items``."""

    def __init__(self, repo: Repository, dev: torch.device, *, cuda_graphs: bool = True,
                 embeddings: str = "device", graphs: str | None = None, precision: str = "fp32",
                 max_batch: int = 0, warn: bool = True) -> None:
        """``graphs`` overrides the mode ``cuda_graphs`` picks (``padded`` runs the CPU twin of graphs);
        ``precision`` is ``--ranking-precision`` (``recpipe.ranking.precision``; the library's default
        is fp32, the same scores every time); ``max_batch`` is the most requests a forward will carry
        (the stage's ``--max-batch``; 0 = its auto: 32 on a GPU, ``SEGMENT_USERS`` in the segmented CPU
        form, else 1): the user buckets warmed. ``warn``: log a warning when the precision asked for breaks
        the bound (a stage serving it; ``recpipe bench ranking`` loads every precision on purpose and says it
        in its table)."""
        RankingOptions(cuda_graphs, precision, embeddings)  # the options' own checks (UsageError)
        if embeddings == "host" and dev.type != "cuda":
            raise UsageError(f"--embeddings host needs a CUDA device, the ranking device is {dev}")
        shapes = repo.section("shapes")
        cfg = artifacts.load_config(repo)
        self.user_dense_dim = int(shapes.get("user_dense_dim", -1))
        self.item_dense_dim = int(shapes.get("item_dense_dim", -1))
        n_user_tables = int(shapes.get("user_sparse_dim", -1))
        if (cfg.user_dense_dim, cfg.item_dense_dim) != (self.user_dense_dim, self.item_dense_dim) or n_user_tables < 0 or \
                cfg.num_tables != n_user_tables + int(shapes.get("item_sparse_dim", -1)):
            raise ArtifactMismatch(
                f"{repo.root / artifacts.DLRM_CONFIG_FILE}: DLRM expects {cfg.dense_dim} dense / {cfg.num_tables} sparse inputs, "
                f"manifest shapes give {self.user_dense_dim}+{self.item_dense_dim} / "
                f"{shapes.get('user_sparse_dim')}+{shapes.get('item_sparse_dim')}"
            )
        model = artifacts.load_model(repo, cfg)
        self.model_version = repo.version
        self.torch_device = dev
        self.device = devices.describe(dev)
        self.config = cfg
        sizes = np.asarray(cfg.table_sizes, dtype=np.int64)
        self.user_table_sizes = sizes[:n_user_tables]
        self.item_table_sizes = sizes[n_user_tables:]
        self.predictor = Predictor(model, dev, graphs or mode_for(dev, cuda_graphs))
        self.embeddings = embeddings
        if embeddings == "host":
            if not isinstance(model.sparse_arch, SparseArch):
                raise ArtifactMismatch("--embeddings host needs the fused embedding tables")
            tables = model.sparse_arch.tables
            tables.weight = torch.nn.Parameter(host_mapped(tables.weight, dev), requires_grad=False)
            if dev.type == "cuda":
                torch.cuda.empty_cache()  # the device copy of the tables is garbage now
        self.predictor.set_user_tables(n_user_tables)
        self.checks: dict[str, probes.FormCheck] = {}
        self.precision = self._choose_precision(precision, repo, n_user_tables, warn)
        auto_users = MAX_USERS if dev.type == "cuda" else SEGMENT_USERS if self.predictor.segmented else 1
        self.max_users = min(max_batch or auto_users, MAX_USERS)
        self.predictor.warm_buckets(self.max_users)

    def _choose_precision(self, requested: str, repo: Repository, n_user_tables: int,
                          warn: bool = True) -> precisions.Choice:
        """Resolve ``requested`` (``auto``: time each eligible form on a 1 x 500 request here), after
        checking each candidate form against fp32 on the probe rows, and make ``self.predictor`` run the
        chosen form."""
        current = self.predictor
        by_form = repo.section("metrics").get("ranking_auc_by_precision") or None
        if requested != "auto":  # a form this machine cannot run is refused before anything is built
            precisions.choose(requested, self.torch_device, None, {})
        candidates: dict[str, Predictor] = {}
        if self.torch_device.type == "cpu":
            wanted = precisions.available(self.torch_device) if requested == "auto" else (requested,)
            for form in wanted:
                if form != current.precision and form in precisions.FORMS:
                    candidates[form] = Predictor(current.model, self.torch_device, current.graphs, form)
                    candidates[form].set_user_tables(n_user_tables)
        if candidates:
            probe = probes.load(repo, self.limits) or probes.synthetic(self.limits)
            reference = probes.scores(current, probe)
            self.checks = {form: probes.check(form, reference, probes.scores(p, probe), probe)
                           for form, p in candidates.items()}
        timers = {form: functools.partial(p.warm_up, [DEFAULT_NUM_CANDIDATES])
                  for form, p in {current.precision: current, **candidates}.items()} if requested == "auto" else {}
        choice = precisions.choose(requested, self.torch_device, by_form, timers, checks=self.checks)
        broken = self.checks.get(choice.form)
        if warn and broken is not None and not broken.ok:
            _log.warning("ranking: --ranking-precision %s %s", choice.form, broken.describe())
        if choice.form != current.precision:
            self.predictor = candidates.get(choice.form) or Predictor(current.model, self.torch_device, current.graphs,
                                                                      choice.form)
            if self.predictor.num_user_tables != n_user_tables:
                self.predictor.set_user_tables(n_user_tables)
        return choice

    @classmethod
    def load(cls, models_dir: Path, device: str = "auto", *, cuda_graphs: bool = True, embeddings: str = "device",
             graphs: str | None = None, precision: str = "fp32", max_batch: int = 0, warn: bool = True) -> RankingCore:
        return cls(Repository.open(Path(models_dir)), devices.resolve(device), cuda_graphs=cuda_graphs,
                   embeddings=embeddings, graphs=graphs, precision=precision, max_batch=max_batch, warn=warn)

    @property
    def details(self) -> dict[str, str]:
        """For InfoService: how the forward runs, in which precision and why, and the CPU's ISA."""
        return {"cuda_graphs": self.predictor.graphs, "graphs_captured": str(self.predictor.graphs_captured),
                "embeddings": self.embeddings if self.embeddings == "device" else "host (pinned, zero-copy)",
                "interaction": self.config.interaction,
                "wide": _wide(self.config),
                "precision": self.precision.form + (" (torch.compile)" if self.predictor.compiled else ""),
                "batch_forward": _batch_forward(self.predictor, self.users_per_forward),
                "precision_choice": self.precision.reason, "cpu_isa": precisions.describe_isa(),
                "precision_bound": f"max |dp| <= {probes.MAX_ABS_DP:g}, dAUC >= -{precisions.AUC_BUDGET:g} against fp32",
                **({"precision_check": self.checks[self.precision.form].describe()}
                   if self.precision.form in self.checks else {}),
                "warmed": _warmed(self.predictor),
                traffic.KEY: self.predictor.io.traffic.describe()}

    @property
    def limits(self) -> RankingLimits:
        return RankingLimits(self.user_dense_dim, self.item_dense_dim, self.user_table_sizes, self.item_table_sizes)

    def rank(self, user: UserFeatures, items: ItemFeatures) -> np.ndarray:
        """(k,) click probabilities for the user's candidates (the arrays checked by ``RankQuery``)."""
        return self.rank_batch([RankQuery.checked(user.dense, user.sparse, items.dense, items.sparse, self.limits)])[0]

    @property
    def users_per_forward(self) -> int:
        """Queries per forward at most: 1 where the predictor runs a batch one user at a time (a compiled
        CPU form without segments: ``Predictor.per_user``), the users warmed for where the forward serves
        warmed buckets (CUDA graphs, the segmented CPU form), else ``CHUNK_USERS``."""
        if self.predictor.per_user:
            return 1
        return self.max_users if self.predictor.mode != "eager" else CHUNK_USERS

    def rank_batch(self, queries: Sequence[RankQuery]) -> list[np.ndarray]:
        """DLRM forwards over every query's candidates, split back: each (k_i,) float32 equals what the
        query would get alone. A forward carries at most ``CHUNK_ROWS`` candidates and ``users_per_forward``
        queries (the user-side work still done once per query in it); a query with more candidates than
        that runs as several forwards. So every forward's shape has a bucket that was warmed at load, and
        the working set stays bounded."""
        pieces: list[list[np.ndarray]] = [[] for _ in queries]
        chunk: list[tuple[int, RankQuery]] = []
        rows = 0
        users = self.users_per_forward
        for i, q in enumerate(queries):
            for part in _split(q, CHUNK_ROWS):
                if chunk and (rows + part.k > CHUNK_ROWS or len(chunk) == users):
                    self._forward(chunk, pieces)
                    chunk, rows = [], 0
                chunk.append((i, part))
                rows += part.k
        if chunk:
            self._forward(chunk, pieces)
        return [p[0] if len(p) == 1 else np.concatenate(p) for p in pieces]

    def _forward(self, chunk: Sequence[tuple[int, RankQuery]], pieces: list[list[np.ndarray]]) -> None:
        queries = [q for _, q in chunk]
        counts = [q.k for q in queries]
        scores = self.predictor.score_batch(
            np.stack([q.user_dense for q in queries]),
            np.stack([q.user_sparse for q in queries]),
            np.concatenate([q.item_dense for q in queries]) if len(queries) > 1 else queries[0].item_dense,
            np.concatenate([q.item_sparse for q in queries]) if len(queries) > 1 else queries[0].item_sparse,
            counts,
        )
        start = 0
        for (i, _), n in zip(chunk, counts, strict=True):
            pieces[i].append(scores[start : start + n])
            start += n


def _split(q: RankQuery, rows: int) -> list[RankQuery]:
    """``q`` as queries of at most ``rows`` candidates each (itself when it fits)."""
    if q.k <= rows:
        return [q]
    return [RankQuery(q.user_dense, q.user_sparse, q.item_dense[s : s + rows], q.item_sparse[s : s + rows])
            for s in range(0, q.k, rows)]


def _warmed(predictor: Predictor) -> str:
    """For InfoService: the shapes run at load, and how many forwards have run eagerly since for want of a
    warmed bucket (a compiled or captured form; never compiled on the request path)."""
    if not predictor.warmed:
        return f"eager: {predictor.warm_runs} sizes run once at load in {predictor.warm_s:.2f} s"
    users = sorted({u for u, _ in predictor.warmed})
    rows = sorted({r for _, r in predictor.warmed})
    return (f"{len(predictor.warmed)} shapes ({users[0]}-{users[-1]} users x {rows[0]}-{rows[-1]} candidates) in "
            f"{predictor.warm_s:.2f} s; {predictor.unwarmed_forwards} forwards since ran eagerly (shape not warmed)")


def _batch_forward(predictor: Predictor, users: int) -> str:
    """For InfoService: how a batch of requests meets the forward."""
    if predictor.segmented:
        return (f"segmented, up to {users} requests: one compiled call for their own terms, one matmul per "
                "request, one for the rest")
    if predictor.per_user:
        why = " (int8 scales each call's activations: batch-mates would move the scores)" \
            if predictor.precision == "int8" else ""
        return "one forward per request" + why
    return f"up to {users} requests per forward"


def _wide(config: DLRMConfig) -> str:
    """The wide part, as InfoService shows it."""
    if config.wide_table is None:
        return "none"
    (us, ue), (is_, ie) = config.wide_user_columns, config.wide_item_columns
    return (f"user dense columns {us}-{ue - 1} x item dense columns {is_}-{ie - 1} and x table "
            f"{config.wide_table}'s vector")
