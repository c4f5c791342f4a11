"""Scores candidates with a trained DLRM under ``eval()`` + ``torch.inference_mode()``.

``score_candidates`` exploits that one request is one user and k items: every interaction pair
between two user-side vectors (the user's dense vector and its 44 embeddings: 990 of the 1891 pairs)
is the same for all k candidates, and so is its contribution to the first layer of the top MLP. That
part is computed once per request; per candidate only the pairs that involve an item-side vector are
computed and multiplied by their columns of the first layer. The result equals ``model(dense, sparse)``
up to float rounding (checked by the tests), at about half the cost.

``score_batch`` on a CUDA device replays a CUDA graph per bucketed (users, candidates) shape
(``recpipe.accel.cuda_graphs``): the inputs are padded with zeros up to the bucket in pinned host buffers,
copied asynchronously on the stage's stream, and the answer is sliced back. Padded candidates belong
to user 0 and padded users have no candidates, so the real rows' scores do not change. The CPU runs
the same padding eagerly in ``padded`` mode (what the tests compare with the unpadded answer) and no
padding at all by default.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from recpipe.accel.cuda_graphs import GraphRunner, bucket
from recpipe.accel.transfer import DeviceIO
from recpipe.ranking.model import DLRM, SparseArch

#: Candidate-count buckets start here: fewer rows than this cost a GPU no more than this many.
MIN_ROWS_BUCKET = 64


class Predictor:
    """``graphs``: ``eager`` (no padding; the CPU default), ``padded`` (bucketed shapes run eagerly: the
    CPU twin of graphs, or CUDA with graphs off) or ``graph`` (CUDA graph replay per bucket)."""

    def __init__(self, model: DLRM, device: torch.device, graphs: str = "eager") -> None:
        self.model = model.to(device).eval()
        self.device = device
        self.graphs = graphs
        self.io = DeviceIO(device)
        self.num_user_tables = 0
        self._split: _UserSplit | None = None
        self._runner: GraphRunner | None = None

    def set_user_tables(self, num_user_tables: int) -> None:
        """Enable the factorised path: the first ``num_user_tables`` sparse features belong to the user."""
        self.num_user_tables = num_user_tables
        split = _UserSplit(self.model, num_user_tables).to(self.device)
        split.gather_segments = self.graphs != "eager" or self.device.type != "cpu"
        self._split = split

        def probabilities(*inputs: torch.Tensor) -> torch.Tensor:
            ud, us, idn, isp, *seg = inputs
            return torch.sigmoid(split(ud, us, idn, isp, seg[0] if seg else None))

        self._runner = GraphRunner(probabilities, self.device, self.graphs)

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
        counts: list[int],
    ) -> np.ndarray:
        """B users' candidates in one forward: (B, Du), (B, U), (N, Di), (N, I) with N = sum(counts),
        the first counts[0] items belonging to user 0 and so on -> (N,) float32 probabilities."""
        runner = self._runner
        if runner is None:
            raise RuntimeError("score_batch needs set_user_tables() first")
        b, n = len(counts), int(sum(counts))
        users, rows = (bucket(b), bucket(n, MIN_ROWS_BUCKET)) if runner.padded else (b, n)
        io = self.io
        with torch.inference_mode(), io.stream():
            inputs = [io.put("user_dense", user_dense, np.float32, users),
                      io.put("user_sparse", user_sparse, np.int64, users),
                      io.put("item_dense", item_dense, np.float32, rows),
                      io.put("item_sparse", item_sparse, np.int64, rows)]
            if users > 1:  # padded candidates belong to user 0
                inputs.append(io.put("segments", np.repeat(np.arange(b, dtype=np.int64), counts), np.int64, rows))
            return io.fetch("scores", runner(*inputs), n)

    def warm_up(self, counts: list[int]) -> None:
        """Run (and, in ``graph`` mode, capture) the shape of ``counts`` once, on zeros."""
        cfg = self.model.config
        b, n, u = len(counts), int(sum(counts)), self.num_user_tables
        self.score_batch(np.zeros((b, cfg.user_dense_dim), np.float32), np.zeros((b, u), np.int64),
                         np.zeros((n, cfg.item_dense_dim), np.float32), np.zeros((n, cfg.num_tables - u), np.int64),
                         counts)


class _UserSplit(nn.Module):
    """The DLRM forward for one user x k items with the user-only work done once (see module doc)."""

    w_user_dense: torch.Tensor
    w_item_dense: torch.Tensor
    w_const: torch.Tensor
    w_var: torch.Tensor
    bias: torch.Tensor
    const_src: torch.Tensor
    var_src: torch.Tensor

    def __init__(self, model: DLRM, num_user_tables: int) -> None:
        super().__init__()
        self.model = model
        if not isinstance(model.sparse_arch, SparseArch):
            raise TypeError("the factorised path needs the fused SparseArch")
        self.tables = model.sparse_arch.tables
        cfg = model.config
        d = cfg.embedding_dim
        f = cfg.num_tables
        u_tab = num_user_tables
        n = f + 2
        # vector order in the interaction: [user dense, item dense, user tables..., item tables...]
        user_vecs = [0, *range(2, 2 + u_tab)]
        item_vecs = [1, *range(2 + u_tab, n)]
        pos_u = {v: i for i, v in enumerate(user_vecs)}
        pos_i = {v: i for i, v in enumerate(item_vecs)}
        nu, ni = len(user_vecs), len(item_vecs)
        rows, cols = torch.triu_indices(n, n, offset=1)
        const_cols: list[int] = []
        var_cols: list[int] = []
        var_src: list[int] = []  # index into [item x user dots (ni*nu), item x item dots (ni*ni)]
        const_src: list[int] = []  # index into user x user dots (nu*nu)
        for p, (a, b) in enumerate(zip(rows.tolist(), cols.tolist(), strict=True)):
            col = 2 * d + p
            if a in pos_u and b in pos_u:
                const_cols.append(col)
                const_src.append(pos_u[a] * nu + pos_u[b])
            elif a in pos_i and b in pos_i:
                var_cols.append(col)
                var_src.append(ni * nu + pos_i[a] * ni + pos_i[b])
            else:
                i, u = (a, b) if a in pos_i else (b, a)
                var_cols.append(col)
                var_src.append(pos_i[i] * nu + pos_u[u])
        first = model.over_arch.model[0]
        if not isinstance(first, nn.Linear):
            raise TypeError("the top MLP must start with a Linear layer")
        w = first.weight.detach()
        self.register_buffer("w_user_dense", w[:, :d].clone(), persistent=False)
        self.register_buffer("w_item_dense", w[:, d : 2 * d].clone(), persistent=False)
        self.register_buffer("w_const", w[:, const_cols].clone(), persistent=False)
        self.register_buffer("w_var", w[:, var_cols].clone(), persistent=False)
        self.register_buffer("bias", first.bias.detach().clone(), persistent=False)
        self.register_buffer("const_src", torch.tensor(const_src, dtype=torch.long), persistent=False)
        self.register_buffer("var_src", torch.tensor(var_src, dtype=torch.long), persistent=False)
        self.u_tab = u_tab
        self.rest = model.over_arch.model[1:]
        #: How items meet their user's vectors when B > 1: a per-item gather + batched matmul (static
        #: shapes, what CUDA graphs need; padded rows break the per-user runs) or one matmul per user over
        #: its contiguous items (far cheaper on a CPU). Both give the same scores.
        self.gather_segments = True

    def forward(
        self, ud: torch.Tensor, us: torch.Tensor, idn: torch.Tensor, isp: torch.Tensor, seg: torch.Tensor | None
    ) -> torch.Tensor:
        """ud (B, Du), us (B, U), idn (N, Di), isp (N, I), seg (N,) user index of each item (None when
        B == 1) -> (N,) logits."""
        m = self.model
        offsets = self.tables.offsets
        weight = self.tables.weight
        user_vec = m.user_dense_arch(ud)  # (B, D)
        user_emb = torch.nn.functional.embedding(us + offsets[: self.u_tab], weight)  # (B, U, D)
        u = torch.cat([user_vec[:, None, :], user_emb], dim=1)  # (B, nu, D)
        const = torch.bmm(u, u.transpose(1, 2)).flatten(1).index_select(1, self.const_src)  # (B, 990)
        h0 = self.bias + const @ self.w_const.T + user_vec @ self.w_user_dense.T  # (B, H)
        item_vec = m.item_dense_arch(idn)  # (N, D)
        item_emb = torch.nn.functional.embedding(isp + offsets[self.u_tab :], weight)  # (N, I, D)
        v = torch.cat([item_vec[:, None, :], item_emb], dim=1)  # (N, ni, D)
        if seg is None:  # one user: a plain matmul against its vectors, no per-item copy of them
            vu = (v @ u[0].T).flatten(1)  # (N, ni*nu)
            h_user = h0
        elif self.gather_segments:  # static shapes (CUDA graphs): each item gathers its user's vectors
            vu = torch.bmm(v, u.index_select(0, seg).transpose(1, 2)).flatten(1)
            h_user = h0.index_select(0, seg)
        else:  # one matmul per user over its contiguous items: far cheaper on a CPU than N tiny ones
            counts = torch.bincount(seg, minlength=u.shape[0]).tolist()
            vu = torch.cat([part @ u[i].T for i, part in enumerate(torch.split(v, counts)) if part.shape[0]])
            vu = vu.flatten(1)
            h_user = h0.index_select(0, seg)
        vv = torch.bmm(v, v.transpose(1, 2)).flatten(1)  # (N, ni*ni)
        x_var = torch.cat([vu, vv], dim=1).index_select(1, self.var_src)  # (N, #var pairs)
        h = h_user + item_vec @ self.w_item_dense.T + x_var @ self.w_var.T  # (N, H)
        return self.rest(h).squeeze(-1)
