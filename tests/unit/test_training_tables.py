"""The DLRM tables' start (recpipe/training/tables.py): which stay at zero, and the exposure vectors."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from recpipe.training import tables


def test_sparse_tables_are_those_with_few_rows_per_id() -> None:
    # 10,000 rows an epoch: 100 per id for a 100-row table (kept), 50 per id for a 200-row one (frozen)
    assert tables.sparse_tables((100, 200, 99, 5000), 10_000, 100.0) == [1, 3]
    assert tables.sparse_tables((100, 200, 99, 5000), 10_000, 0.0) == []


def test_frozen_rows_stay_zero_under_adam_and_the_rest_learn() -> None:
    torch.manual_seed(0)
    sizes = (3, 4, 5)
    weight = torch.nn.Parameter(torch.randn(sum(sizes), 2))
    before = weight.detach().clone()
    handle = tables.zero_rows(weight, tables.row_mask(sizes, [1]))
    assert handle is not None
    opt = torch.optim.Adam([weight], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss = (weight[torch.tensor([0, 3, 5, 8])] ** 2).sum() + weight.sum()  # every row gets a gradient
        loss.backward()
        opt.step()
    assert torch.count_nonzero(weight[3:7]) == 0  # table 1: zeroed at the start and never moved
    assert not torch.equal(weight[:3], before[:3]) and not torch.equal(weight[7:], before[7:])
    handle.remove()


def test_zero_rows_without_keep_zeroes_and_hooks_nothing() -> None:
    weight = torch.nn.Parameter(torch.ones(5, 2))
    assert tables.zero_rows(weight, tables.row_mask((2, 3), [0]), keep=False) is None
    assert torch.count_nonzero(weight[:2]) == 0 and torch.equal(weight[2:], torch.ones(3, 2))
    (weight * 2).sum().backward()  # no hook: the zeroed rows' gradient is not masked
    assert torch.equal(weight.grad, torch.full((5, 2), 2.0))


def test_exposure_vectors_recover_what_each_id_was_shown_with() -> None:
    rng = np.random.default_rng(0)
    size, dim = 41, 3
    truth = rng.standard_normal((size, dim))  # a direction per id (1..39; 40 is never shown)
    mix = rng.standard_normal((dim, 6))
    # each impression's user leans towards the id shown: its row is the id's direction mixed into 6
    # columns, plus noise (one user per impression); id 0 (null / unseen) is shown too and must
    # still come out as zeros
    shown = rng.integers(0, size - 1, 40_000)
    rows = truth[shown] @ mix + rng.standard_normal((40_000, 6)) * 0.5
    out = tables.exposure_vectors(rows.astype(np.float32), np.arange(40_000), shown, size, dim)
    assert out.shape == (size, dim) and out.dtype == np.float32
    assert not out[0].any() and not out[size - 1].any()
    seen = np.arange(1, size - 1)
    # the vectors are a linear image of the planted directions (PCA fixes them up to a rotation)
    coef, *_ = np.linalg.lstsq(np.c_[out[seen], np.ones(len(seen))], truth[seen], rcond=None)
    resid = truth[seen] - np.c_[out[seen], np.ones(len(seen))] @ coef
    assert 1 - resid.var() / truth[seen].var() > 0.95
    counts = np.bincount(shown, minlength=size)[seen]
    w = counts / counts.sum()
    assert np.sqrt((w[:, None] * out[seen] ** 2).sum() / dim) == pytest.approx(tables.EXPOSURE_RMS, rel=1e-4)
    # more components asked than there are columns: the rest are zeros
    wide = tables.exposure_vectors(rows.astype(np.float32), np.arange(40_000), shown, size, 8)
    assert not wide[:, 6:].any() and wide[:, :6].any()


def test_train_dlrm_reports_and_keeps_its_table_start(noise_rows: Any) -> None:
    from recpipe.training import loops
    from recpipe.training.config import TrainConfig

    n = 4000
    core, users, items, labels, counts = noise_rows(n, 5)
    cfg = TrainConfig(epochs=2, min_steps=10, ranking_min_rows_per_id=3.0)
    model, stats = loops.train_dlrm(core, users, items, labels, counts, cfg, torch.device("cpu"))
    names = core.preprocessor.sparse_names("users") + core.preprocessor.sparse_names("items")
    sizes = model.config.table_sizes
    assert stats["exposure_table"] == tables.EXPOSURE_COLUMN
    frozen = stats["frozen_tables"]
    assert frozen and set(frozen) < set(names)
    weight = model.sparse_arch.tables.weight.detach()
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for t, name in enumerate(names):
        block = weight[offsets[t] : offsets[t + 1]]
        assert (torch.count_nonzero(block) == 0) == (name in frozen), name
    # the leaf table is not random: its rows' scale is the exposure scale, not the 0.05 start
    leaf = names.index(tables.EXPOSURE_COLUMN)
    if tables.EXPOSURE_COLUMN not in frozen:
        assert weight[offsets[leaf] + 1 : offsets[leaf + 1]].abs().mean() > 0.2
    # a leaf table too sparse itself is zeroed like the others, and not reported as started from exposure
    # (the threshold sits above the leaf table's rows per id however many rows validation holds back)
    sparse = TrainConfig(epochs=1, min_steps=10, ranking_min_rows_per_id=n / sizes[leaf] + 1.0)
    _, both = loops.train_dlrm(core, users, items, labels, counts, sparse, torch.device("cpu"))
    assert tables.EXPOSURE_COLUMN in both["frozen_tables"] and both["exposure_table"] is None
    off = TrainConfig(epochs=1, min_steps=10, ranking_min_rows_per_id=0.0, ranking_exposure_init=False)
    _, plain = loops.train_dlrm(core, users, items, labels, counts, off, torch.device("cpu"))
    assert plain["frozen_tables"] == [] and plain["exposure_table"] is None


def test_cosine_schedule_decays_to_its_floor_and_constant_stays() -> None:
    from recpipe.training import loops

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([{"params": [param]}, {"params": [], "lr": 0.5}], lr=1.0)
    schedule = loops.lr_schedule(opt, "cosine", 10)
    seen = []
    for _ in range(12):  # past the planned steps: it stays at the floor
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        schedule.step()
    assert seen[0] == [1.0, 0.5]
    assert all(a[0] > b[0] for a, b in itertools.pairwise(seen[:11]))  # falls every planned step
    assert seen[-1][0] == pytest.approx(loops.FINAL_LR_FACTOR)
    assert seen[-1][1] == pytest.approx(0.5 * loops.FINAL_LR_FACTOR)
    opt2 = torch.optim.Adam([param], lr=1.0)
    constant = loops.lr_schedule(opt2, "constant", 10)
    for _ in range(5):
        opt2.step()
        constant.step()
    assert opt2.param_groups[0]["lr"] == 1.0
