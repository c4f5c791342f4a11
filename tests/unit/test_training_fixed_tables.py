"""The fixed-table training forward: the model's own logits and the same gradients for every weight
that learns, with none computed for the tables (recpipe/training/fixed_tables.py)."""

from __future__ import annotations

import copy

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


Grads = dict[str, torch.Tensor]


def _model_then_fixed(model: DLRM, dense: torch.Tensor, sparse: torch.Tensor, y: torch.Tensor
                      ) -> tuple[torch.Tensor, Grads, torch.Tensor, Grads]:
    """A logistic-loss step through the model itself, then (its tables frozen) through
    ``FixedTableForward``: each one's logits and the gradient of every weight that got one."""

    def grads(forward: object) -> tuple[torch.Tensor, Grads]:
        model.zero_grad(set_to_none=True)
        logits = forward(dense, sparse)  # type: ignore[operator]
        torch.nn.functional.binary_cross_entropy_with_logits(logits, y).backward()
        return logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    want_logits, want = grads(model)
    model.sparse_arch.tables.weight.requires_grad_(False)
    got_logits, got = grads(FixedTableForward(model))
    return want_logits, want, got_logits, got


@pytest.mark.parametrize(("tables", "wide_table"), [((7, 3, 11, 5), None), ((9,), None), ((2, 2), None),
                                                    ((7, 3, 11, 5), 2), ((9,), 0)])
def test_logits_and_learning_gradients_match_the_model(tables: tuple[int, ...], wide_table: int | None) -> None:
    model = _model(tables=tables, wide_table=wide_table)
    dense, sparse = _inputs(model)
    y = torch.randint(0, 2, (len(dense),), generator=torch.Generator().manual_seed(2)).float()
    want_logits, want, got_logits, got = _model_then_fixed(model, dense, sparse, y)
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


@pytest.mark.parametrize(("tables", "wide_table"), [((7, 3, 11, 5), None), ((9,), None), ((7, 3, 11, 5), 2)])
def test_in_float64_it_is_the_models_function(tables: tuple[int, ...], wide_table: int | None) -> None:
    """Where rounding cannot hide a difference: any other column split, pair order or missing term is
    off by far more than float64's 1e-15 (measured: 2e-16 logits, 2e-15 gradients)."""
    model = _model(tables=tables, wide_table=wide_table).double()
    dense, sparse = _inputs(model)
    dense = dense.double()
    y = torch.randint(0, 2, (len(dense),), generator=torch.Generator().manual_seed(2)).double()
    want_logits, want, got_logits, got = _model_then_fixed(model, dense, sparse, y)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-12, atol=1e-14)
    assert set(got) == set(want) - {"sparse_arch.tables.weight"}
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-12, atol=1e-14, msg=name)


def test_under_bf16_autocast_it_is_as_near_the_exact_step_as_the_model() -> None:
    """The training step on CPUs with native bf16 (``loops.dlrm_autocast``; emulated, slower, elsewhere):
    every product is rounded to bf16 (relative 2^-9), so the two forwards cannot agree to float32's
    rounding. What holds is that the fixed-table step is as near the float64 step as the model's own,
    and nearer the model's than either is to float64. At the trained shape (60 tables of dim 16, top
    MLP 128-64, a wide part), 8 seeds: error ratio 0.998-1.001 (logits), 0.999-1.043 (gradients); the
    two steps apart by 0.01-0.05 (logits) and 0.13-0.45 (gradients) of the model's own error. The
    first layer's output, on the same bf16 inputs: relative error 1.70e-3 against the model's 1.66e-3
    (2.35e-3, 1.42 times the model's, when its two column blocks were multiplied and added apart)."""
    torch.manual_seed(0)
    sizes = tuple(int(n) for n in torch.randint(2, 50, (60,)))
    model = DLRM(DLRMConfig(user_dense_dim=40, item_dense_dim=30, table_sizes=sizes, embedding_dim=16,
                            bottom_dims=(), top_dims=(128, 64), wide_table=3, wide_user_columns=(1, 9),
                            wide_item_columns=(0, 8)))
    assert model.wide is not None
    with torch.no_grad():
        for p in model.wide.parameters():
            p.normal_(0.0, 0.1)
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(512, model.config.dense_dim, generator=g)
    sparse = torch.stack([torch.randint(0, n, (512,), generator=g) for n in sizes], 1)
    y = torch.randint(0, 2, (512,), generator=g).double()
    first, relu = model.over_arch.model[0], model.over_arch.model[1]
    seen: dict[str, torch.Tensor] = {}
    relu.register_forward_pre_hook(lambda _, args: seen.__setitem__("h", args[0].detach().double()))
    model.interaction.register_forward_hook(lambda _, args, out: seen.__setitem__("x", out.detach()))

    def step(m: DLRM, forward: object, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, every learning weight's gradient, flat) in float64."""
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = forward(dense.to(next(m.parameters()).dtype), sparse)  # type: ignore[operator]
        torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), y).backward()
        return logits.detach().double(), torch.cat([p.grad.double().flatten() for p in m.parameters()
                                                    if p.grad is not None])

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    exact = copy.deepcopy(model).double()
    exact.sparse_arch.tables.weight.requires_grad_(False)
    exact_logits, exact_grads = step(exact, exact, bf16=False)
    model.sparse_arch.tables.weight.requires_grad_(False)
    own_logits, own_grads = step(model, model, bf16=True)
    own_h, x = seen["h"], seen["x"]
    assert x.dtype == torch.bfloat16  # the autocast path is the one taken
    fixed_logits, fixed_grads = step(model, FixedTableForward(model), bf16=True)
    for got, own, want in ((fixed_logits, own_logits, exact_logits), (fixed_grads, own_grads, exact_grads)):
        assert rel(got, want) <= 1.1 * rel(own, want)
        assert rel(got, own) < rel(own, want)
    # the first layer's output against float64 arithmetic on the same bf16 inputs and weights
    with torch.no_grad():
        h = torch.nn.functional.linear(x.double(), first.weight.bfloat16().double(), first.bias.bfloat16().double())
    assert rel(seen["h"], h) <= 1.25 * rel(own_h, h)
