"""The DLRM's training forward when its embedding tables do not learn (issue 23).

With the tables fixed at their start (``ranking_embedding_lr`` 0: random, zero or exposure rows, see
``recpipe.training.tables``), most of a dot-interaction step is work whose result is thrown away:

- of the N(N-1)/2 pairwise dots, only the 2N-3 that involve the user's or the item's dense vector
  depend on a weight; the F(F-1)/2 among the F table vectors are constants of the row;
- so the top MLP's first layer needs no input gradient for those columns, the dots' batched product
  no backward for them, and the tables no gradient at all.

``FixedTableForward`` computes the same logits as ``DLRM.forward`` (same weights, same pair order) and
the same gradients for every weight that learns, but builds the graph only through the dense vectors
(and the wide part, when the model has one). The model keeps its shape: serving and the saved weights
do not change. "The same" is exact in float64 (to 1e-15), to float32 rounding in float32, and under
bf16 autocast (the training steps on CPUs with native bf16, ``loops.dlrm_autocast``) as near the
float64 values as the model's own forward. There every product's output is rounded to bf16, so the
first layer adds the learning columns' product onto the constant columns' inside one ``addmm``,
rounding its output once more than the model's one linear (a separate product and a bf16 add rounded
it twice more). Relative error of that output on the same inputs at the trained shape: 1.70e-3, the
model's 1.66e-3, 2.35e-3 with the separate add (tests/unit/test_training_fixed_tables.py).
At full scale on 2 cores a step takes about half the time (BENCHMARKS.md, issue 23).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recpipe.ranking.model import DLRM, InteractionArch


def applies(model: DLRM) -> bool:
    """Whether the split forward can stand in for ``model``'s: the dot interaction and a top MLP whose
    first layer is linear (``DLRMConfig`` already requires at least one table)."""
    return isinstance(model.interaction, InteractionArch) and isinstance(model.over_arch.model[0], nn.Linear)


class FixedTableForward:
    """``model``'s training forward with the table vectors treated as constants.

    The interaction's output is laid out as [dense vectors | dots (i, j), i < j, row-major]. The pairs
    with i < g (a dense vector on the left) come first, then the table-table pairs, whose row-major
    order is the table vectors' own upper triangle; so the first layer's weight splits into the
    columns that see a learning input and the columns that see a constant one.
    """

    def __init__(self, model: DLRM) -> None:
        if not applies(model):
            raise ValueError("the fixed-table forward needs the dot interaction and a linear first top layer")
        self.model = model
        n, f, d = model.config.num_vectors, model.config.num_tables, model.config.embedding_dim
        g = n - f  # the dense vectors (user, item) in front of the table vectors
        device = next(model.parameters()).device
        # the learning dots: rows 0..g-1 of the (g, n) block of dense-vector dots, right of the diagonal
        rows, cols = torch.triu_indices(g, n, offset=1)
        self.live = (rows * n + cols).to(device)
        rows, cols = torch.triu_indices(f, f, offset=1)
        self.fixed = (rows * f + cols).to(device)
        self.split = g * d + len(self.live)  # first-layer columns fed by learning inputs
        first = model.over_arch.model[0]
        assert isinstance(first, nn.Linear)
        self.first = first
        self.rest = model.over_arch.model[1:]

    def __call__(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        m = self.model
        vectors = m.dense_vectors(dense)
        with torch.no_grad():
            tables = m.sparse_arch(sparse)  # (B, F, D), constants
            fixed = torch.bmm(tables, tables.transpose(1, 2)).flatten(1).index_select(1, self.fixed)
        x = torch.cat([vectors, tables], dim=1)  # (B, N, D)
        live = torch.bmm(vectors, x.transpose(1, 2)).flatten(1).index_select(1, self.live)
        w = self.first.weight
        # under bf16 autocast every product's output is rounded to bf16: added inside one addmm, the
        # first layer's output is rounded once more than by the model's one linear, not twice (module docstring)
        h = torch.addmm(F.linear(fixed, w[:, self.split :], self.first.bias),
                        torch.cat([vectors.flatten(1), live], dim=1), w[:, : self.split].t())
        return m.with_wide(self.rest(h).squeeze(-1), dense, tables)  # its table vector is a constant too
