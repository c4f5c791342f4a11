"""Schedules, user ids and candidate counts of the query generator (pure numpy, seeded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recpipe.errors import UsageError
from recpipe.querygen.workload import (
    QueryStream,
    UserSpec,
    fixed_candidates,
    load_quantile_file,
    open_schedule,
    parse_lognormal,
    poisson_arrivals,
)


def test_poisson_schedule_is_exact_count_float_seconds_and_exponential() -> None:
    t = poisson_arrivals(2000.0, 5.0, seed=3)
    assert t.dtype == np.float64 and t.shape == (10_000,)
    assert np.all(np.diff(t) > 0) and t[0] > 0 and t[-1] < 5.0
    # Not on a millisecond grid: almost every arrival has a fractional millisecond.
    frac_ms = (t * 1000) % 1.0
    assert np.mean((frac_ms > 1e-6) & (frac_ms < 1 - 1e-6)) > 0.99
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / 2000, rel=0.03)
    # Exponential gaps: coefficient of variation 1, P(gap > mean) = 1/e.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    assert np.mean(gaps > gaps.mean()) == pytest.approx(np.exp(-1), abs=0.02)


def test_poisson_schedule_is_seeded() -> None:
    a, b, c = poisson_arrivals(100, 2, 1), poisson_arrivals(100, 2, 1), poisson_arrivals(100, 2, 2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_open_schedule_puts_the_exact_count_in_the_measured_window() -> None:
    t = open_schedule(7.5, warmup=1.0, duration=4.0, seed=5)
    assert np.all(np.diff(t) > 0)
    assert np.sum(t < 1.0) == 8 and np.sum((t >= 1.0) & (t < 5.0)) == 30 and t[-1] < 5.0
    assert np.array_equal(open_schedule(7.5, 0.0, 4.0, 5), poisson_arrivals(7.5, 4.0, 5))


@pytest.mark.parametrize("rate", [0.0, -5.0, float("nan"), float("inf")])
def test_poisson_schedule_rejects_bad_rate(rate: float) -> None:
    with pytest.raises(UsageError, match="rate"):
        poisson_arrivals(rate, 1.0, 0)


def test_lognormal_candidates_have_the_given_median_and_spread() -> None:
    spec = parse_lognormal("lognormal:300,0.5")
    x = spec.sample(np.random.default_rng(0), 50_000)
    assert x.dtype == np.int64 and x.min() >= 1
    assert np.median(x) == pytest.approx(300, rel=0.03)
    assert np.std(np.log(x)) == pytest.approx(0.5, rel=0.05)
    assert spec.describe() == "lognormal:300,0.5"


@pytest.mark.parametrize("bad", ["lognormal:300", "normal:3,1", "lognormal:a,1", "lognormal:-1,1",
                                 "lognormal:100,-0.1"])
def test_bad_lognormal_spec_is_a_usage_error(bad: str) -> None:
    with pytest.raises(UsageError, match="candidates-dist"):
        parse_lognormal(bad)


def test_fixed_candidates_bounds() -> None:
    assert np.all(fixed_candidates(7).sample(np.random.default_rng(0), 5) == 7)
    with pytest.raises(UsageError):
        fixed_candidates(0)


def test_quantile_file_pairs_sampled_by_inverse_cdf(tmp_path: Path) -> None:
    f = tmp_path / "q.txt"
    f.write_text("# quantile value\n0 100\n0.5 200\n0.9 1000\n1.0 2000\n\n")
    spec = load_quantile_file(f)
    x = spec.sample(np.random.default_rng(1), 100_000)
    assert x.min() >= 100 and x.max() <= 2000
    assert np.quantile(x, 0.5) == pytest.approx(200, rel=0.02)
    assert np.quantile(x, 0.9) == pytest.approx(1000, rel=0.02)
    assert np.quantile(x, 0.25) == pytest.approx(150, rel=0.03)  # linear between the points


def test_quantile_file_values_only_are_equally_spaced(tmp_path: Path) -> None:
    f = tmp_path / "q.txt"
    f.write_text("10\n20\n30\n40\n50\n")
    x = load_quantile_file(f).sample(np.random.default_rng(2), 50_000)
    assert np.quantile(x, 0.5) == pytest.approx(30, abs=1)
    assert np.quantile(x, 0.75) == pytest.approx(40, abs=1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0 10\n0.5 5\n1 20\n", "non-decreasing"),
        ("0 10\n0.5 20\n0.4 30\n", "strictly increasing"),
        ("0 10\n20\n", "mixes"),
        ("0 ten\n1 20\n", "not a number"),
        ("5\n", "at least 2"),
        ("0 0\n1 20\n", "1.."),
    ],
)
def test_bad_quantile_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "q.txt"
    f.write_text(text)
    with pytest.raises(UsageError, match=message):
        load_quantile_file(f)


def test_unreadable_quantile_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read"):
        load_quantile_file(tmp_path / "missing.txt")


def test_uniform_and_zipf_users() -> None:
    rng = np.random.default_rng(0)
    u = UserSpec("uniform", 100).sampler(0).sample(rng, 100_000)
    assert u.min() == 0 and u.max() == 99
    assert np.bincount(u).max() / np.bincount(u).min() < 1.3
    z = UserSpec("zipf", 1000, 1.0).sampler(0).sample(rng, 100_000)
    assert z.min() >= 0 and z.max() < 1000
    counts = np.sort(np.bincount(z, minlength=1000))[::-1]
    # Zipf(1) over 1000: the top user gets 1/H(1000) ~ 13% of queries, the 10th ~ 1.3%.
    assert counts[0] / 100_000 == pytest.approx(1 / np.sum(1 / np.arange(1, 1001)), rel=0.05)
    assert counts[0] / counts[9] == pytest.approx(10, rel=0.15)
    # The popular users are spread over the id range, not just the smallest ids.
    top10 = set(np.argsort(np.bincount(z, minlength=1000))[-10:].tolist())
    assert top10 != set(range(10))


def test_bad_user_specs() -> None:
    with pytest.raises(UsageError, match="uniform or zipf"):
        UserSpec("pareto", 10)
    with pytest.raises(UsageError):
        UserSpec("uniform", 0)


def test_query_stream_is_deterministic_across_blocks() -> None:
    users, cands = UserSpec("uniform", 50), parse_lognormal("lognormal:100,1")
    a, b = QueryStream(users, cands, 5), QueryStream(users, cands, 5)
    idx = [0, 1, QueryStream.BLOCK + 3, 3 * QueryStream.BLOCK - 1]
    assert [a[i] for i in idx] == [b[i] for i in reversed(idx)][::-1]
    assert [a[i] for i in range(10)] != [QueryStream(users, cands, 6)[i] for i in range(10)]
