"""The factorised DLRM forward: one request is one user and k items, so the user-only work runs once.

Every interaction pair between two user-side vectors (the user's dense vector and its 44 embeddings:
990 of the 1891 pairs) is the same for all k candidates, and so is its contribution to the first layer
of the top MLP. That part is computed once per request. The item x user pairs' columns are folded with
the user's vectors once per request too (``_UserSplit._folded``), so per candidate the first layer
reads the item's own vectors, and only the item x item pairs are computed as dots. The wide part, when
the model has one, splits the same way (``WideArch.user`` once per user, ``WideArch.item`` per
candidate). The result equals ``model(dense, sparse)`` up to float rounding (checked by the tests), at
about half the cost.

``user_split`` builds it from a trained ``DLRM`` (``_UserSplit`` for the dot interaction,
``_DcnUserSplit`` for DCN); ``recpipe.ranking.predictor`` runs it (eagerly, compiled, segmented or as
CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from recpipe.nn import FusedEmbedding
from recpipe.ranking.model import DLRM, SparseArch, WideArch

#: A user's candidates meet its vectors through the folded weights (``_UserSplit._folded``) from this
#: many on; fewer take the item x user dots themselves. The fold costs H*ni*nu*D multiply-adds once per
#: user: for a user with a few candidates (the held-out rows ``recpipe train`` scores, a ranking stage's
#: probe at load) that is most of the forward. This part of the forward, fp32, one user, 2-core AVX2
#: EPYC, folded against unfolded: 1 candidate 89 against 28 us, 16: 104 against 84, 32: 118 against 132.
FOLD_MIN_ROWS = 24


def _vector_order(model: DLRM, num_user_tables: int) -> tuple[list[int], list[int]]:
    """Positions of the user-side and item-side vectors in the interaction's order
    [user dense, item dense, user tables..., item tables...]."""
    n = model.config.num_vectors
    return [0, *range(2, 2 + num_user_tables)], [1, *range(2 + num_user_tables, n)]


def _wide_item(model: DLRM, num_user_tables: int) -> int:
    """The wide part's table among the item tables (-1: no wide part); it must be an item table, whose
    vector the factorised forward looks up per candidate."""
    table = model.config.wide_table
    if table is None:
        return -1
    if table < num_user_tables:
        raise ValueError(f"the wide part's table ({table}) must be an item table (from {num_user_tables})")
    return table - num_user_tables


def _wide_logits(wide: WideArch, column: int, ud: torch.Tensor, idn: torch.Tensor, item_emb: torch.Tensor,
                 seg: torch.Tensor | None) -> torch.Tensor:
    """(N,) the wide part's logits: its user part once per user, then per candidate."""
    user_part = wide.user(ud)  # (B, Pi + D + 1)
    if seg is not None:
        user_part = user_part.index_select(0, seg)
    return wide.item(user_part, idn, item_emb[:, column])


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None and layer.bias is not None:
            layer.bias.copy_(bias)
    return layer


def user_split(model: DLRM, num_user_tables: int) -> nn.Module:
    """The factorised forward for ``model``'s interaction (``_UserSplit`` or ``_DcnUserSplit``)."""
    if not isinstance(model.sparse_arch, SparseArch):
        raise TypeError("the factorised path needs the fused SparseArch")
    if model.config.interaction == "dcn":
        return _DcnUserSplit(model, num_user_tables)
    return _UserSplit(model, num_user_tables)


class _UserSplit(nn.Module):
    """The DLRM forward for one user x k items with the user-only work done once (see module doc).

    The first layer of the top MLP is split by what its inputs depend on: ``user_first`` over [user
    vector, user x user dots] (once per user), the item vector's and the item x user dots' columns
    folded with each user's vectors (``_folded``: once per user, then one matmul per candidate), and
    the item x item dots: ``item_item_first`` over the full (ni, ni) Gram matrix (weights on its upper
    triangle, zeros elsewhere: what the CUDA forms and their padded CPU twin run) or, with ``gram_pairs``
    (the CPU forms: eager fp32 and int8, and the compiled segmented bf16), ``item_pair_first`` over the
    upper triangle's ni(ni-1)/2 dots alone (a gather and half the multiply-adds: 0.46 against 0.68 ms for
    this block at 500 candidates in fp32 on a 2-core AVX2 EPYC; the whole compiled bf16 forward of 8 x 500
    4-6% less per request on a 2-core AVX512-BF16 EPYC, a lone request the same within noise: ``recpipe
    bench ranking --requests 8``).
    Where items gather their users' vectors (static shapes for CUDA graphs, several users per forward) the
    fold cannot apply, and ``item_vec_first`` and ``item_user_first`` take every item x user dot. The
    folded weights are computed per call, so the int8 form quantizes every ``nn.Linear`` but not them.
    A user with fewer than ``FOLD_MIN_ROWS`` candidates on the eager CPU path skips the fold
    (``_unfolded``): its items' dots with its vectors times the same unquantized weights, the same sum in
    another order. Which way a user's rows go depends on its own count only, never on its batch-mates.
    """

    user_src: torch.Tensor
    w_iu_fold: torch.Tensor
    w_vec_fold: torch.Tensor
    item_pairs: torch.Tensor

    def __init__(self, model: DLRM, num_user_tables: int) -> None:
        super().__init__()
        self.user_dense_arch = model.user_dense_arch
        self.item_dense_arch = model.item_dense_arch
        tables = model.sparse_arch.tables
        assert isinstance(tables, FusedEmbedding)
        self.tables = tables
        cfg = model.config
        d = cfg.embedding_dim
        n = cfg.num_vectors
        user_vecs, item_vecs = _vector_order(model, num_user_tables)
        pos_u = {v: i for i, v in enumerate(user_vecs)}
        pos_i = {v: i for i, v in enumerate(item_vecs)}
        nu, ni = len(user_vecs), len(item_vecs)
        first = model.over_arch.model[0]
        if not isinstance(first, nn.Linear):
            raise TypeError("the top MLP must start with a Linear layer")
        w = first.weight.detach()
        hidden = w.shape[0]
        w_iu = torch.zeros(hidden, ni * nu, dtype=w.dtype, device=w.device)
        w_ii = torch.zeros(hidden, ni * ni, dtype=w.dtype, device=w.device)
        user_cols: list[int] = list(range(d))  # first-layer columns fed by [user vector, user x user dots]
        user_src: list[int] = list(range(d))  # ... and where each comes from in that concatenation
        rows, cols = torch.triu_indices(n, n, offset=1)
        for p, (a, b) in enumerate(zip(rows.tolist(), cols.tolist(), strict=True)):
            col = 2 * d + p
            if a in pos_u and b in pos_u:
                user_cols.append(col)
                user_src.append(d + pos_u[a] * nu + pos_u[b])
            elif a in pos_i and b in pos_i:
                w_ii[:, pos_i[a] * ni + pos_i[b]] = w[:, col]
            else:
                i, u = (a, b) if a in pos_i else (b, a)
                w_iu[:, pos_i[i] * nu + pos_u[u]] = w[:, col]
        self.user_first = _linear(w[:, user_cols], first.bias.detach())
        self.item_vec_first = _linear(w[:, d : 2 * d], None)
        self.item_user_first = _linear(w_iu, None)
        self.item_item_first = _linear(w_ii, None)
        pairs = torch.triu_indices(ni, ni, offset=1, device=w.device)
        pairs = pairs[0] * ni + pairs[1]  # the upper triangle's columns: every nonzero one of w_ii
        self.item_pair_first = _linear(w_ii[:, pairs], None)
        self.register_buffer("item_pairs", pairs, persistent=False)
        self.register_buffer("user_src", torch.tensor(user_src, dtype=torch.long), persistent=False)
        # The item x user columns folded with a user's vectors: (H * ni, nu), and the item vector's
        # columns in the folded layout (H, ni, D), nonzero only in slot 0 (see ``_folded``).
        self.register_buffer("w_iu_fold", w_iu.reshape(hidden * ni, nu).clone(), persistent=False)
        w_vec = torch.zeros(hidden, ni, d, dtype=w.dtype, device=w.device)
        w_vec[:, 0] = w[:, d : 2 * d]
        self.register_buffer("w_vec_fold", w_vec, persistent=False)
        self.hidden, self.ni = hidden, ni
        self.u_tab = num_user_tables
        self.rest = model.over_arch.model[1:]
        self.wide = model.wide
        self.wide_item = _wide_item(model, num_user_tables)
        #: How items meet their user's vectors when B > 1: a per-item gather + batched matmul (static
        #: shapes, what CUDA graphs need; padded rows break the per-user runs) or one matmul per user over
        #: its contiguous items (far cheaper on a CPU). Both give the same scores.
        self.gather_segments = True
        #: Whether the item x item part takes the upper triangle's dots alone (``item_pair_first``)
        #: rather than the full Gram matrix (``item_item_first``). The same scores up to rounding.
        self.gram_pairs = False

    def forward(
        self, ud: torch.Tensor, us: torch.Tensor, idn: torch.Tensor, isp: torch.Tensor, seg: torch.Tensor | None
    ) -> torch.Tensor:
        """ud (B, Du), us (B, U), idn (N, Di), isp (N, I), seg (N,) user index of each item (None when
        B == 1) -> (N,) logits."""
        u, h0 = self._users(ud, us)
        item_vec, item_emb, v = self._items(idn, isp)
        flat = v.flatten(1)  # (N, ni*D)
        if seg is None:  # one user: its vectors folded into the item columns' weights (unless it has few items)
            h_items = h0 + (flat @ self._folded(u)[0].T if flat.shape[0] >= FOLD_MIN_ROWS else self._unfolded(v, u, None))
        elif self.gather_segments:  # static shapes (CUDA graphs): each item gathers its user's vectors
            vu = torch.bmm(v, u.index_select(0, seg).transpose(1, 2)).flatten(1)
            h_items = h0.index_select(0, seg) + self.item_vec_first(item_vec) + self.item_user_first(vu)
        else:  # one matmul per user over its contiguous items: far cheaper on a CPU than N tiny ones
            h_items = self._per_user(h0, u, v, flat, seg)
        return self._top(h_items, self._item_dots(v), ud, idn, item_emb, seg)

    def _per_user(self, h0: torch.Tensor, u: torch.Tensor, v: torch.Tensor, flat: torch.Tensor,
                  seg: torch.Tensor) -> torch.Tensor:
        """The first layer's user-dependent part for rows in user order (seg (N,)): each user's rows times
        its folded weights, one matmul per user, or, for users with fewer than ``FOLD_MIN_ROWS`` rows,
        their dots unfolded in one pass over all of them -> (N, H)."""
        counts = torch.bincount(seg, minlength=u.shape[0]).tolist()
        few = [c < FOLD_MIN_ROWS for c in counts]
        if all(few):
            return h0.index_select(0, seg) + self._unfolded(v, u, seg)
        many = [i for i, f in enumerate(few) if not f]
        folded = dict(zip(many, self._folded(u[many]), strict=True))
        unfolded: Iterator[torch.Tensor] = iter(())  # the few-row users' parts, in user order
        if any(few):
            rows = torch.tensor(few, device=seg.device).index_select(0, seg).nonzero().squeeze(1)
            at = seg.index_select(0, rows)
            unfolded = iter(torch.split(h0.index_select(0, at) + self._unfolded(v.index_select(0, rows), u, at),
                                        [c for c, f in zip(counts, few, strict=True) if f]))
        return torch.cat([h0[i] + part @ folded[i].T if i in folded else next(unfolded)
                          for i, part in enumerate(torch.split(flat, counts))])

    def _unfolded(self, v: torch.Tensor, u: torch.Tensor, seg: torch.Tensor | None) -> torch.Tensor:
        """(n, ni, D) items, (B, nu, D) users and seg (n,) each item's user (None: user 0) -> (n, H): the
        item vector's and the item x user dots' part of the first layer, the sum ``_folded`` takes over
        the same weights, without folding: every item's dots with its user's vectors, then one matmul."""
        mine = u[0].T if seg is None else u.index_select(0, seg).transpose(1, 2)
        vu = torch.matmul(v, mine).flatten(1)  # (n, ni*nu)
        return vu @ self.w_iu_fold.view(self.hidden, -1).T + v[:, 0] @ self.w_vec_fold[:, 0].T

    def _users(self, ud: torch.Tensor, us: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ud (B, Du), us (B, U) -> the users' vectors (B, nu, D) and their first-layer part h0 (B, H)."""
        weight = self.tables.weight
        user_vec = self.user_dense_arch(ud.to(weight.dtype))  # (B, D)
        user_emb = torch.nn.functional.embedding(us + self.tables.offsets[: self.u_tab], weight)  # (B, U, D)
        u = torch.cat([user_vec[:, None, :], user_emb], dim=1)  # (B, nu, D)
        uu = torch.bmm(u, u.transpose(1, 2)).flatten(1)  # (B, nu*nu)
        return u, self.user_first(torch.cat([user_vec, uu], dim=1).index_select(1, self.user_src))

    def _items(self, idn: torch.Tensor, isp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """idn (N, Di), isp (N, I) -> the item vector (N, D), embeddings (N, I, D) and both as (N, ni, D)."""
        weight = self.tables.weight
        item_vec = self.item_dense_arch(idn.to(weight.dtype))  # (N, D)
        item_emb = torch.nn.functional.embedding(isp + self.tables.offsets[self.u_tab :], weight)  # (N, I, D)
        return item_vec, item_emb, torch.cat([item_vec[:, None, :], item_emb], dim=1)

    def _item_dots(self, v: torch.Tensor) -> torch.Tensor:
        """(N, ni, D) -> the item x item dots ``_top`` takes: (N, ni*ni), or (N, ni(ni-1)/2) with ``gram_pairs``."""
        dots = torch.bmm(v, v.transpose(1, 2)).flatten(1)
        return dots.index_select(1, self.item_pairs) if self.gram_pairs else dots

    def _top(self, h_items: torch.Tensor, vv: torch.Tensor, ud: torch.Tensor, idn: torch.Tensor,
             item_emb: torch.Tensor, seg: torch.Tensor | None) -> torch.Tensor:
        """The first layer's item x item part added to ``h_items`` (N, H), the rest of the top MLP and the
        wide part -> (N,) logits."""
        h = h_items + (self.item_pair_first if self.gram_pairs else self.item_item_first)(vv)  # (N, H)
        logits = self.rest(h).squeeze(-1)
        if self.wide is not None:
            dtype = self.tables.weight.dtype
            logits = logits + _wide_logits(self.wide, self.wide_item, ud.to(dtype), idn.to(dtype), item_emb, seg)
        return logits

    def prepare(self, ud: torch.Tensor, us: torch.Tensor, idn: torch.Tensor,
                isp: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The segmented form's first part (``recpipe.ranking.segmented``): every per-user and per-item
        term of B users and N candidates, in one call -> h0 (B, H), the folded weights (B, H, ni*D), the
        items' flattened vectors (N, ni*D), their item x item dots (N, ni*ni) and embeddings (N, I, D)."""
        u, h0 = self._users(ud, us)
        _, item_emb, v = self._items(idn, isp)
        return h0, self._folded(u), v.flatten(1), self._item_dots(v), item_emb

    def finish(self, h_items: torch.Tensor, vv: torch.Tensor, ud: torch.Tensor, idn: torch.Tensor,
               item_emb: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        """The segmented form's last part: ``h_items`` (N, H), each user's h0 plus its candidates times
        its folded weights -> (N,) float32 probabilities."""
        return torch.sigmoid(self._top(h_items, vv, ud, idn, item_emb, seg).float())

    def _folded(self, u: torch.Tensor) -> torch.Tensor:
        """(B, nu, D) user vectors -> (B, H, ni*D): each user's weights over an item's flattened vectors,
        the item x user dots and the item vector's own columns in one. sum_u W[h, i, u] <v_i, u_u> is
        <v_i, sum_u W[h, i, u] u_u>: folding costs H*ni*nu*D once per user and leaves H*ni*D per
        candidate, instead of ni*nu*(D + H) (128 x 272 against 765 x 144 multiply-adds here)."""
        folded = torch.matmul(self.w_iu_fold, u)  # (B, H*ni, D)
        return (folded.view(u.shape[0], self.hidden, self.ni, -1) + self.w_vec_fold).flatten(2)


class _DcnUserSplit(nn.Module):
    """The DCN forward for one user x k items with the user-only work done once.

    The cross layers act element-wise on x0, so their coordinates may be reordered freely: the copy
    kept here orders x0 as [user vectors (nu*D), item vectors (ni*D)], which makes the first layer's
    rank projection ``V_0 x0 = V_0u x_user + V_0i x_item`` with the user term computed once per user.
    The later layers and the top MLP run per candidate on the full (N, N*D) state.
    """

    def __init__(self, model: DLRM, num_user_tables: int) -> None:
        super().__init__()
        from recpipe.ranking.model import DCNInteractionArch

        if not isinstance(model.interaction, DCNInteractionArch):
            raise TypeError("the DCN split needs a DCN interaction")
        self.user_dense_arch = model.user_dense_arch
        self.item_dense_arch = model.item_dense_arch
        tables = model.sparse_arch.tables
        assert isinstance(tables, FusedEmbedding)
        self.tables = tables
        d = model.config.embedding_dim
        user_vecs, item_vecs = _vector_order(model, num_user_tables)
        perm = torch.tensor([v * d + j for v in user_vecs + item_vecs for j in range(d)])
        mu = len(user_vecs) * d
        cross = model.interaction.crossnet
        vs = [v for v in cross.v if isinstance(v, nn.Linear)]
        ws = [w for w in cross.w if isinstance(w, nn.Linear)]
        v0 = vs[0].weight.detach()[:, perm]
        self.v0_user = _linear(v0[:, :mu], None)
        self.v0_item = _linear(v0[:, mu:], None)
        self.v = nn.ModuleList(_linear(v.weight.detach()[:, perm], None) for v in vs[1:])
        self.w = nn.ModuleList(_linear(w.weight.detach()[perm], w.bias.detach()[perm]) for w in ws)
        first = model.over_arch.model[0]
        if not isinstance(first, nn.Linear):
            raise TypeError("the top MLP must start with a Linear layer")
        self.top = nn.Sequential(_linear(first.weight.detach()[:, perm], first.bias.detach()),
                                 *list(model.over_arch.model)[1:])
        self.u_tab = num_user_tables
        self.gather_segments = True  # the same answer either way here: one gather of the user rows
        self.wide = model.wide
        self.wide_item = _wide_item(model, num_user_tables)

    def forward(
        self, ud: torch.Tensor, us: torch.Tensor, idn: torch.Tensor, isp: torch.Tensor, seg: torch.Tensor | None
    ) -> torch.Tensor:
        """ud (B, Du), us (B, U), idn (N, Di), isp (N, I), seg (N,) or None (B == 1) -> (N,) logits."""
        offsets = self.tables.offsets
        weight = self.tables.weight
        dtype = weight.dtype
        user_vec = self.user_dense_arch(ud.to(dtype))  # (B, D)
        user_emb = torch.nn.functional.embedding(us + offsets[: self.u_tab], weight)  # (B, U, D)
        xu = torch.cat([user_vec[:, None, :], user_emb], dim=1).flatten(1)  # (B, nu*D)
        pu = self.v0_user(xu)  # (B, r)
        item_vec = self.item_dense_arch(idn.to(dtype))  # (N, D)
        item_emb = torch.nn.functional.embedding(isp + offsets[self.u_tab :], weight)  # (N, I, D)
        xi = torch.cat([item_vec[:, None, :], item_emb], dim=1).flatten(1)  # (N, ni*D)
        if seg is None:
            x0 = torch.cat([xu.expand(xi.shape[0], -1), xi], dim=1)
        else:
            x0 = torch.cat([xu.index_select(0, seg), xi], dim=1)
            pu = pu.index_select(0, seg)
        x = x0 * self.w[0](pu + self.v0_item(xi)) + x0
        for v, w in zip(self.v, self.w[1:], strict=True):
            x = x0 * w(v(x)) + x
        logits = self.top(x).squeeze(-1)
        if self.wide is not None:
            logits = logits + _wide_logits(self.wide, self.wide_item, ud.to(dtype), idn.to(dtype), item_emb, seg)
        return logits
