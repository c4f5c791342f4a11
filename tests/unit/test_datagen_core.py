"""recpipe.datagen cores: the batched sampler, the row gather, the AUC and the exact oracle top-k."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from recpipe.datagen import DatagenConfig
from recpipe.datagen.click_model import DEFAULT_MODEL, log_sigmoid
from recpipe.datagen.oracle import _TrueScorer, auc
from recpipe.datagen.sampling import PackedTable, gather_dot, table_from_weights, take_rows
from recpipe.datagen.world import make_world


def test_packed_table_samples_each_row_from_its_distribution() -> None:
    rng = np.random.default_rng(0)
    weights = rng.random((3, 5)) ** 3
    weights[1, 2] = 0.0  # an impossible value is never drawn
    table = table_from_weights(weights)
    rows = np.repeat(np.arange(3), 100_000)
    flat = table.sample(rows, table.uniforms(rng, rows.shape[0]))
    assert np.all(flat // 5 == rows)
    for r in range(3):
        freq = np.bincount(flat[rows == r] % 5, minlength=5) / 100_000
        np.testing.assert_allclose(freq, weights[r] / weights[r].sum(), atol=0.006)
    assert np.all(flat[rows == 1] % 5 != 2)


def test_packed_table_handles_batches_larger_than_the_packing() -> None:
    table = PackedTable(np.array([0.25, 1.0]), np.zeros(2, np.int64), 1)
    rng = np.random.default_rng(1)
    n = (1 << 20) + 5
    out = table.sample(np.zeros(n, np.int64), table.uniforms(rng, n))
    assert out.shape == (n,) and abs(out.mean() - 0.75) < 0.003


def test_gather_dot_and_take_rows_match_numpy() -> None:
    rng = np.random.default_rng(2)
    a = rng.standard_normal((50, 16), dtype=np.float32)
    b = rng.standard_normal((70, 16), dtype=np.float32)
    ai, bi = rng.integers(0, 50, 100_000), rng.integers(0, 70, 100_000)
    np.testing.assert_allclose(gather_dot(a, ai, b, bi), np.einsum("ij,ij->i", a[ai], b[bi]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(take_rows(a, ai[:10]), a[ai[:10]])


def test_auc_matches_pairwise_definition_with_ties() -> None:
    rng = np.random.default_rng(3)
    s = rng.integers(0, 5, 300).astype(float)
    y = rng.random(300) < 0.3
    pos, neg = s[y], s[~y]
    brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (pos.size * neg.size)
    assert auc(s, y) == pytest.approx(brute)
    assert auc(s, np.zeros(300)) is None


def test_oracle_top_k_is_exact() -> None:
    """The pruned top-k equals brute-force scoring of every item."""
    world = make_world(DatagenConfig(scale=0.005, seed=5), DEFAULT_MODEL, 90)
    scorer = _TrueScorer(world)
    it, us, model = world.items, world.users, world.model
    for user in range(0, us.n, 37):
        with np.errstate(divide="ignore"):
            lpc = np.log(scorer.p_cat(user))
        logit = model.logit(it.v(0, it.n) @ us.u[user], it.q, it.cat == us.pref[user])
        full = lpc[it.cat] + np.log(it.w / it.cat_weight[it.cat]) + log_sigmoid(logit)
        got = scorer.top_k(user, 50)
        assert got.shape == (50,) and np.unique(got).shape == (50,)
        # the same set as brute force, up to float32 ties at the boundary
        kth = np.sort(full)[-50]
        assert full[got].min() >= kth - 1e-4
        assert np.sum(full > kth + 1e-4) <= np.sum(np.isin(np.flatnonzero(full > kth + 1e-4), got))


def test_world_does_not_depend_on_how_blocks_are_scheduled() -> None:
    """Blocks run on two threads in any order give the same world as one thread in order."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = DatagenConfig(scale=0.1, seed=9)  # 85,000 items: two blocks
    serial = make_world(cfg, DEFAULT_MODEL, 90)
    with ThreadPoolExecutor(2) as pool:
        def backwards(fn: Callable[[int, int, int], None], bl: list[tuple[int, int]]) -> None:
            for f in [pool.submit(fn, b, lo, hi) for b, (lo, hi) in reversed(list(enumerate(bl)))]:
                f.result()

        threaded = make_world(cfg, DEFAULT_MODEL, 90, backwards)
    for name in ("cat", "brand", "shop", "q", "w", "order", "v_pos"):
        np.testing.assert_array_equal(getattr(serial.items, name), getattr(threaded.items, name))
    for name in ("fine", "pref", "u", "activity"):
        np.testing.assert_array_equal(getattr(serial.users, name), getattr(threaded.users, name))
