"""The fixed-table training forward: the model's own logits and the same gradients for every weight
that learns, with none computed for the tables (recpipe/training/fixed_tables.py)."""

from __future__ import annotations

import pytest
import torch

from recpipe.ranking.model import DLRM, DLRMConfig
from recpipe.training import fixed_tables
from recpipe.training.fixed_tables import FixedTableForward


def _model(interaction: str = "dot", tables: tuple[int, ...] = (7, 3, 11, 5), wide_table: int | None = None) -> DLRM:
    torch.manual_seed(0)
    model = DLRM(DLRMConfig(user_dense_dim=6, item_dense_dim=4, table_sizes=tables, embedding_dim=4,
                            bottom_dims=(), top_dims=(8, 4), interaction=interaction, wide_table=wide_table,
                            wide_user_columns=(1, 5), wide_item_columns=(0, 3)))
    if model.wide is not None:  # it starts at zero: give it weights that show in the logits
        with torch.no_grad():
            for p in model.wide.parameters():
                p.normal_(0.0, 0.3)
    return model


def _inputs(model: DLRM, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(batch, model.config.dense_dim, generator=g)
    sparse = torch.stack([torch.randint(0, n, (batch,), generator=g) for n in model.config.table_sizes], 1)
    return dense, sparse


@pytest.mark.parametrize(("tables", "wide_table"), [((7, 3, 11, 5), None), ((9,), None), ((2, 2), None),
                                                    ((7, 3, 11, 5), 2), ((9,), 0)])
def test_logits_and_learning_gradients_match_the_model(tables: tuple[int, ...], wide_table: int | None) -> None:
    model = _model(tables=tables, wide_table=wide_table)
    dense, sparse = _inputs(model)
    y = torch.randint(0, 2, (len(dense),), generator=torch.Generator().manual_seed(2)).float()

    def grads(forward: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = forward(dense, sparse)  # type: ignore[operator]
        torch.nn.functional.binary_cross_entropy_with_logits(logits, y).backward()
        return logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    want_logits, want = grads(model)
    model.sparse_arch.tables.weight.requires_grad_(False)
    got_logits, got = grads(FixedTableForward(model))
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-6)
    table = "sparse_arch.tables.weight"
    assert table in want and table not in got  # the tables take no gradient
    assert set(got) == set(want) - {table}
    assert (wide_table is not None) == any(name.startswith("wide.") for name in got)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_it_refuses_the_dcn_interaction() -> None:
    model = _model("dcn")
    assert not fixed_tables.applies(model)
    with pytest.raises(ValueError, match="dot interaction"):
        FixedTableForward(model)
