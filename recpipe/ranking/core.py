"""The ranking core: DLRM click probabilities for one user's k candidate items.

On a CUDA device the forward replays a CUDA graph per bucketed batch shape (``cuda_graphs``) and the
embedding tables may stay in pinned host memory, read by the GPU in place (``embeddings="host"``).
"""

from __future__ import annotations

import functools
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
from recpipe.ranking.contract import RankingLimits, RankQuery
from recpipe.ranking.model import DLRMConfig, SparseArch
from recpipe.ranking.options import RankingOptions
from recpipe.ranking.predictor import Predictor
from recpipe.repository import Repository
from recpipe.types import ItemFeatures, UserFeatures

#: Candidates per DLRM forward at most when requests are batched (a single request may exceed it).
CHUNK_ROWS = 4096


class RankingCore:
    """``rank(user, items)`` -> (k,) float32 click probabilities, in the order of ``items``."""

    def __init__(self, repo: Repository, dev: torch.device, *, cuda_graphs: bool = True,
                 embeddings: str = "device", graphs: str | None = None, precision: str = "fp32") -> None:
        """``graphs`` overrides the mode ``cuda_graphs`` picks (``padded`` runs the CPU twin of graphs);
        ``precision`` is ``--ranking-precision`` (``recpipe.ranking.precision``; the library's default
        is fp32, the same scores every time)."""
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
        self.precision = self._choose_precision(precision, repo, n_user_tables)
        self.predictor.set_user_tables(n_user_tables)
        if self.predictor.graphs == "graph":  # capture the common shape now, not at the first request
            self.predictor.warm_up([DEFAULT_NUM_CANDIDATES])

    def _choose_precision(self, requested: str, repo: Repository, n_user_tables: int) -> precisions.Choice:
        """Resolve ``requested`` (``auto``: time each eligible form on a 1 x 500 request here) and make
        ``self.predictor`` run the chosen form."""
        current = self.predictor
        by_form = repo.section("metrics").get("ranking_auc_by_precision") or None
        candidates: dict[str, Predictor] = {}
        if requested == "auto" and self.torch_device.type == "cpu":
            for form in precisions.available(self.torch_device):
                candidates[form] = Predictor(current.model, self.torch_device, current.graphs, form)
                candidates[form].set_user_tables(n_user_tables)
        timers = {form: functools.partial(p.warm_up, [DEFAULT_NUM_CANDIDATES]) for form, p in candidates.items()}
        choice = precisions.choose(requested, self.torch_device, by_form, timers)
        if choice.form != current.precision:
            self.predictor = candidates.get(choice.form) or Predictor(current.model, self.torch_device, current.graphs,
                                                                      choice.form)
        return choice

    @classmethod
    def load(cls, models_dir: Path, device: str = "auto", *, cuda_graphs: bool = True, embeddings: str = "device",
             graphs: str | None = None, precision: str = "fp32") -> RankingCore:
        return cls(Repository.open(Path(models_dir)), devices.resolve(device), cuda_graphs=cuda_graphs,
                   embeddings=embeddings, graphs=graphs, precision=precision)

    @property
    def details(self) -> dict[str, str]:
        """For InfoService: how the forward runs, in which precision and why, and the CPU's ISA."""
        return {"cuda_graphs": self.predictor.graphs, "graphs_captured": str(self.predictor.graphs_captured),
                "embeddings": self.embeddings if self.embeddings == "device" else "host (pinned, zero-copy)",
                "interaction": self.config.interaction,
                "wide": _wide(self.config),
                "precision": self.precision.form + (" (torch.compile)" if self.predictor.compiled else ""),
                "precision_choice": self.precision.reason, "cpu_isa": precisions.describe_isa(),
                traffic.KEY: self.predictor.io.traffic.describe()}

    @property
    def limits(self) -> RankingLimits:
        return RankingLimits(self.user_dense_dim, self.item_dense_dim, self.user_table_sizes, self.item_table_sizes)

    def rank(self, user: UserFeatures, items: ItemFeatures) -> np.ndarray:
        """(k,) click probabilities for the user's candidates (the arrays checked by ``RankQuery``)."""
        return self.rank_batch([RankQuery.checked(user.dense, user.sparse, items.dense, items.sparse, self.limits)])[0]

    def rank_batch(self, queries: Sequence[RankQuery]) -> list[np.ndarray]:
        """DLRM forwards over every query's candidates, ``CHUNK_ROWS`` candidates at a time at most (the
        user-side work still done once per query), split back: each (k_i,) float32 equals what the
        query would get alone. The chunks bound the working set: one forward over 32 x 500 candidates
        would hold ~150 MB of intermediates and leave the process that much larger for good."""
        out: list[np.ndarray] = []
        chunk: list[RankQuery] = []
        rows = 0
        for q in queries:
            if chunk and rows + q.k > CHUNK_ROWS:
                out.extend(self._forward(chunk))
                chunk, rows = [], 0
            chunk.append(q)
            rows += q.k
        out.extend(self._forward(chunk))
        return out

    def _forward(self, queries: Sequence[RankQuery]) -> list[np.ndarray]:
        counts = [q.k for q in queries]
        scores = self.predictor.score_batch(
            np.stack([q.user_dense for q in queries]),
            np.stack([q.user_sparse for q in queries]),
            np.concatenate([q.item_dense for q in queries]) if len(queries) > 1 else queries[0].item_dense,
            np.concatenate([q.item_sparse for q in queries]) if len(queries) > 1 else queries[0].item_sparse,
            counts,
        )
        out, start = [], 0
        for n in counts:
            out.append(scores[start : start + n])
            start += n
        return out


def _wide(config: DLRMConfig) -> str:
    """The wide part, as InfoService shows it."""
    if config.wide_table is None:
        return "none"
    (us, ue), (is_, ie) = config.wide_user_columns, config.wide_item_columns
    return (f"user dense columns {us}-{ue - 1} x item dense columns {is_}-{ie - 1} and x table "
            f"{config.wide_table}'s vector")
