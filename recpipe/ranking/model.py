"""DLRM built from small modules, after torchrec's ``models/dlrm.py``.

    user dense (B, Du) --DenseArch--> (B, D) ─┐
    item dense (B, Di) --DenseArch--> (B, D) ─┼─ InteractionArch -> (B, 2D + N(N-1)/2), N = F + 2
    sparse (B, F) --SparseArch--> (B, F, D) ──┘                     └─ OverArch -> (B,) click logits

``interaction="dcn"`` replaces the pairwise dots with DCNv2 low-rank cross layers over the N
concatenated vectors (``DCNInteractionArch``, (B, N*D) out), the interaction of MLPerf's DLRM-v2.

``wide_table`` adds a wide part beside that deep one (``WideArch``, wide & deep): a logistic
regression on the explicit products of some of the user's dense columns with some of the item's and
with one item table's vector, added to the top MLP's logit.

One difference from the textbook DLRM: the user's and the item's dense features get a bottom MLP
each, so they meet in a dot product in the interaction. A single bottom MLP over the concatenation
would have to learn the user-latent x item-latent product with ReLUs, which it does poorly (the
click model of this data is driven by exactly that product).

SparseArch does ONE lookup over all F tables concatenated in one weight (per-table offsets);
``NaiveSparseArch`` is the textbook form (one EmbeddingBag per table) kept for ``recpipe bench ranking``.

Example::

    cfg = DLRMConfig(user_dense_dim=43, item_dense_dim=26, table_sizes=(10,) * 60)
    logits = DLRM(cfg)(torch.randn(4, 69), torch.zeros(4, 60, dtype=torch.long))   # (4,)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from recpipe.errors import ArtifactMismatch
from recpipe.nn import FusedEmbedding, mlp

INTERACTIONS = ("dot", "dcn")


@dataclass(frozen=True)
class DLRMConfig:
    user_dense_dim: int
    item_dense_dim: int
    table_sizes: tuple[int, ...]
    embedding_dim: int = 16
    bottom_dims: tuple[int, ...] = (128, 64)
    top_dims: tuple[int, ...] = (128, 64)
    #: "dot" (pairwise dots, DLRM v1) or "dcn" (DCNv2 low-rank cross layers, DLRM-v2)
    interaction: str = "dot"
    dcn_layers: int = 3
    dcn_rank: int = 64
    #: the wide part (``WideArch``): the table whose vector it multiplies with the user's dense
    #: columns, None for no wide part; and the [start, stop) ranges of the user's and the item's dense
    #: columns whose products it weighs
    wide_table: int | None = None
    wide_user_columns: tuple[int, int] = (0, 0)
    wide_item_columns: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if not self.table_sizes or min(self.table_sizes) < 1:
            raise ValueError("DLRM needs at least one table, each with at least one row")
        if self.user_dense_dim < 1 or self.item_dense_dim < 1 or self.embedding_dim < 1:
            raise ValueError("dense dims and embedding_dim must be >= 1")
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"interaction must be one of {', '.join(INTERACTIONS)}, got {self.interaction!r}")
        if self.dcn_layers < 1 or self.dcn_rank < 1:
            raise ValueError("dcn_layers and dcn_rank must be >= 1")
        if self.wide_table is not None:
            if not 0 <= self.wide_table < len(self.table_sizes):
                raise ValueError(f"wide_table must be a table index in [0, {len(self.table_sizes)}), got {self.wide_table}")
            for name, (start, stop), dim in (("wide_user_columns", self.wide_user_columns, self.user_dense_dim),
                                             ("wide_item_columns", self.wide_item_columns, self.item_dense_dim)):
                if not 0 <= start < stop <= dim:
                    raise ValueError(f"{name} must be a range [start, stop) within [0, {dim}], got ({start}, {stop})")

    @property
    def dense_dim(self) -> int:
        return self.user_dense_dim + self.item_dense_dim

    @property
    def num_tables(self) -> int:
        return len(self.table_sizes)

    @property
    def num_vectors(self) -> int:
        """N: the user and item dense vectors plus one per table."""
        return self.num_tables + 2

    @property
    def over_in_dim(self) -> int:
        n, d = self.num_vectors, self.embedding_dim
        return n * d if self.interaction == "dcn" else 2 * d + n * (n - 1) // 2

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "config") -> DLRMConfig:
        try:
            return cls(
                user_dense_dim=int(data["user_dense_dim"]),
                item_dense_dim=int(data["item_dense_dim"]),
                table_sizes=tuple(int(x) for x in data["table_sizes"]),
                embedding_dim=int(data["embedding_dim"]),
                bottom_dims=tuple(int(x) for x in data["bottom_dims"]),
                top_dims=tuple(int(x) for x in data["top_dims"]),
                # repositories written before the DCN option have the dot interaction
                interaction=str(data.get("interaction", "dot")),
                dcn_layers=int(data.get("dcn_layers", 3)),
                dcn_rank=int(data.get("dcn_rank", 64)),
                # ... and before the wide part, none
                wide_table=None if data.get("wide_table") is None else int(data["wide_table"]),
                wide_user_columns=_column_range(data.get("wide_user_columns", (0, 0))),
                wide_item_columns=_column_range(data.get("wide_item_columns", (0, 0))),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactMismatch(f"{source}: malformed DLRM config ({e!r})") from None


def _column_range(value: Any) -> tuple[int, int]:
    start, stop = (int(x) for x in value)
    return start, stop


class DenseArch(nn.Module):
    """Bottom MLP: (B, Dd) -> (B, D).

    No ReLU on the output (torchrec's has one): two non-negative vectors cannot have a negative dot
    product, and the user-item affinity this vector pair has to express is signed.
    """

    def __init__(self, dense_dim: int, hidden: tuple[int, ...], out_dim: int) -> None:
        super().__init__()
        self.model = mlp([dense_dim, *hidden, out_dim], final_activation=False)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.model(dense)


class SparseArch(nn.Module):
    """(B, F) local ids -> (B, F, D) with one fused lookup over the F tables."""

    def __init__(self, table_sizes: tuple[int, ...], dim: int) -> None:
        super().__init__()
        self.tables = FusedEmbedding(table_sizes, dim)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        return self.tables(sparse)


class NaiveSparseArch(nn.Module):
    """(B, F) -> (B, F, D) with one ``nn.EmbeddingBag`` call per table (the baseline in the bench)."""

    def __init__(self, table_sizes: tuple[int, ...], dim: int) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in table_sizes)

    @classmethod
    def from_fused(cls, fused: SparseArch) -> NaiveSparseArch:
        """Same weights as ``fused``, split into per-table bags (outputs are identical)."""
        offsets = fused.tables.offsets.cpu()  # the bags are built on the CPU, then moved with the model
        sizes = tuple(int(b) for b in torch.diff(torch.cat([offsets, torch.tensor([fused.tables.weight.shape[0]])])))
        naive = cls(sizes, int(fused.tables.weight.shape[1]))
        with torch.no_grad():
            for bag, chunk in zip(naive.bags, torch.split(fused.tables.weight, list(sizes)), strict=True):
                bag.weight.copy_(chunk)  # type: ignore[operator]
        return naive.to(fused.tables.weight.device)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        return torch.stack([bag(sparse[:, t : t + 1]) for t, bag in enumerate(self.bags)], dim=1)


class InteractionArch(nn.Module):
    """Pairwise dots of all feature vectors, upper triangle, after the dense vectors themselves.

    dense (B, G, D) + sparse (B, F, D) -> (B, G*D + N(N-1)/2), N = G + F.
    """

    flat: torch.Tensor

    def __init__(self, num_vectors: int) -> None:
        super().__init__()
        n = num_vectors
        rows, cols = torch.triu_indices(n, n, offset=1)
        # one flat index_select is much cheaper (forward and backward) than indexing with two tensors
        self.register_buffer("flat", rows * n + cols, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = torch.cat([dense, sparse], dim=1)  # (B, N, D)
        dots = torch.bmm(x, x.transpose(1, 2))  # (B, N, N)
        return torch.cat([dense.flatten(1), dots.flatten(1).index_select(1, self.flat)], dim=1)


class LowRankCrossNet(nn.Module):
    """DCNv2 cross layers of rank r (torchrec's ``LowRankCrossNet``): (B, M) -> (B, M),

        x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l,   V_l: M -> r (no bias), W_l: r -> M.
    """

    def __init__(self, in_dim: int, layers: int, rank: int) -> None:
        super().__init__()
        vs = [nn.Linear(in_dim, rank, bias=False) for _ in range(layers)]
        ws = [nn.Linear(rank, in_dim) for _ in range(layers)]
        for v, w in zip(vs, ws, strict=True):
            nn.init.xavier_normal_(v.weight)
            nn.init.xavier_normal_(w.weight)
            nn.init.zeros_(w.bias)
        self.v = nn.ModuleList(vs)
        self.w = nn.ModuleList(ws)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, w in zip(self.v, self.w, strict=True):
            x = x0 * w(v(x)) + x
        return x


class DCNInteractionArch(nn.Module):
    """Cross layers over all feature vectors concatenated: dense (B, G, D) + sparse (B, F, D) -> (B, N*D)."""

    def __init__(self, num_vectors: int, dim: int, layers: int, rank: int) -> None:
        super().__init__()
        self.crossnet = LowRankCrossNet(num_vectors * dim, layers, rank)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.crossnet(torch.cat([dense, sparse], dim=1).flatten(1))


class WideArch(nn.Module):
    """The wide part of a wide & deep model: a logistic regression on explicit products.

    user dense x_u (B, Du), item dense x_i (B, Di), one table's vector e (B, D) -> (B,) logits

        p_u^T A p_i + p_u^T B e + c_u . x_u + c_i . x_i + b

    where p_u and p_i are ranges of the dense columns (``DLRMConfig.wide_user_columns``, ...). Every
    product of a user column with an item column gets its own weight, where the deep part's user-item
    dot is one rank-D bilinear form shared with every other dot the two dense vectors take part in.
    It starts at zero (the deep part alone). ``user`` is what depends on the user alone, so a request
    computes it once for all of its candidates; ``item`` finishes it per candidate.
    """

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.user_columns, self.item_columns = config.wide_user_columns, config.wide_item_columns
        pu = self.user_columns[1] - self.user_columns[0]
        pi = self.item_columns[1] - self.item_columns[0]
        self.user_item = nn.Linear(pu, pi, bias=False)  # p_u -> A^T p_u
        self.user_table = nn.Linear(pu, config.embedding_dim, bias=False)  # p_u -> B^T p_u
        self.user_linear = nn.Linear(config.user_dense_dim, 1)  # c_u . x_u + b
        self.item_linear = nn.Linear(config.item_dense_dim, 1, bias=False)  # c_i . x_i
        for p in self.parameters():
            nn.init.zeros_(p)

    def user(self, xu: torch.Tensor) -> torch.Tensor:
        """(B, Du) -> (B, Pi + D + 1): [A^T p_u, B^T p_u, c_u . x_u + b]."""
        pu = xu[:, self.user_columns[0] : self.user_columns[1]]
        return torch.cat([self.user_item(pu), self.user_table(pu), self.user_linear(xu)], dim=1)

    def item(self, user_part: torch.Tensor, xi: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """``user``'s rows (N or 1, Pi + D + 1), one per candidate or one for all, xi (N, Di), e (N, D) -> (N,)."""
        pi = xi[:, self.item_columns[0] : self.item_columns[1]]
        products = (user_part[:, :-1] * torch.cat([pi, e], dim=1)).sum(-1)
        return products + user_part[:, -1] + self.item_linear(xi).squeeze(-1)

    def forward(self, xu: torch.Tensor, xi: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.item(self.user(xu), xi, e)


class OverArch(nn.Module):
    """Top MLP: (B, in) -> (B,) logits."""

    def __init__(self, in_dim: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.model = mlp([in_dim, *hidden, 1], final_activation=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).squeeze(-1)


class DLRM(nn.Module):
    """dense (B, Dd) float32, sparse (B, F) int64 local ids -> (B,) click logits."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.embedding_dim
        n = config.num_vectors
        self.user_dense_arch = DenseArch(config.user_dense_dim, config.bottom_dims, d)
        self.item_dense_arch = DenseArch(config.item_dense_dim, config.bottom_dims, d)
        self.sparse_arch: nn.Module = SparseArch(config.table_sizes, d)
        self.interaction: nn.Module = (
            DCNInteractionArch(n, d, config.dcn_layers, config.dcn_rank) if config.interaction == "dcn"
            else InteractionArch(n)
        )
        self.over_arch = OverArch(config.over_in_dim, config.top_dims)
        self.wide = None if config.wide_table is None else WideArch(config)

    def dense_vectors(self, dense: torch.Tensor) -> torch.Tensor:
        """(B, Du + Di) -> (B, 2, D): the user's and the item's bottom-layer vectors."""
        du = self.config.user_dense_dim
        return torch.stack([self.user_dense_arch(dense[:, :du]), self.item_dense_arch(dense[:, du:])], dim=1)

    def with_wide(self, logits: torch.Tensor, dense: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """``logits`` plus the wide part's, when the model has one; ``tables`` (B, F, D) the looked-up vectors."""
        if self.wide is None:
            return logits
        du = self.config.user_dense_dim
        return logits + self.wide(dense[:, :du], dense[:, du:], tables[:, self.config.wide_table])

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        tables = self.sparse_arch(sparse)
        return self.with_wide(self.over_arch(self.interaction(self.dense_vectors(dense), tables)), dense, tables)
