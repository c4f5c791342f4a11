"""Histograms, the recorder and the SLO search core of the query generator."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from recpipe.querygen.histogram import LatencyHistogram
from recpipe.querygen.recorder import Measurement, Recorder, merge
from recpipe.querygen.session import achieved_rate
from recpipe.querygen.slo import SloSearch, SloStep, find_max_rate


def test_histogram_percentiles_match_numpy_within_three_digits() -> None:
    x = np.random.default_rng(0).lognormal(np.log(5000), 0.8, 20_000)
    h = LatencyHistogram()
    h.record_many_us(x)
    s = h.summary()
    assert s["count"] == 20_000
    for p, key in [(50, "p50_us"), (90, "p90_us"), (95, "p95_us"), (99, "p99_us"), (99.9, "p999_us")]:
        exact = np.percentile(np.rint(x), p, method="inverted_cdf")
        assert s[key] == pytest.approx(exact, rel=2e-3), key
    assert s["max_us"] == pytest.approx(x.max(), rel=1e-3)
    assert s["mean_us"] == pytest.approx(x.mean(), rel=1e-3)


def test_histogram_bulk_equals_one_by_one_and_clamps() -> None:
    values = [0.2, 1, 999.6, 1000, 5_000_000, 1e13]
    a, b = LatencyHistogram(), LatencyHistogram()
    for v in values:
        a.record_us(v)
    b.record_many_us(values)
    assert a.summary() == b.summary()
    assert a.summary()["min_us"] == 1 and a.summary()["max_us"] >= 3_600_000_000 * 0.999


def test_empty_histogram_summarises_to_zeros() -> None:
    s = LatencyHistogram().summary()
    assert s["count"] == 0 and s["p99_us"] == 0 and s["max_us"] == 0
    assert LatencyHistogram().cdf() == []


def test_recorder_charges_latency_from_the_scheduled_time_and_skips_warmup() -> None:
    rec = Recorder(measure_from=10.0)
    rec.ok(9.0, 9.0, 9.5, [("rank", 100, 120)])  # warm-up
    rec.ok(10.0, 10.004, 10.010, [("rank", 5000, 5100), ("total", 5200, 5300)])  # sent 4 ms late
    rec.error(10.5, 10.5, 10.6, "UNAVAILABLE")
    rec.error(10.6, 10.6, 10.7, "UNAVAILABLE")
    rec.error(10.7, 10.7, 10.8, "DEADLINE_EXCEEDED")
    m = rec.finish()
    assert m.warmup_queries == 1 and m.ok == 1 and m.queries == 4
    assert m.errors == {"UNAVAILABLE": 2, "DEADLINE_EXCEEDED": 1}
    assert m.end_to_end.summary()["p50_us"] == pytest.approx(10_000, rel=1e-3)  # not 6 ms
    assert m.send_lag.summary()["max_us"] == pytest.approx(4000, rel=1e-3)
    assert m.stages["rank"].server.summary()["p50_us"] == pytest.approx(5000, rel=1e-3)
    assert m.stages["rank"].observed.summary()["p50_us"] == pytest.approx(5100, rel=1e-3)
    assert m.stages["total"].observed.count == 1 and m.stages["retrieve"].observed.count == 0
    assert m.last_done == 10.8


def test_failed_queries_keep_their_time_to_failure_through_wire_and_merge() -> None:
    rec = Recorder(measure_from=10.0)
    rec.error(9.9, 9.9, 10.1, "DEADLINE_EXCEEDED")  # warm-up: in no histogram
    rec.ok(10.0, 10.0, 10.010, [("rank", 5000, 5100)])
    rec.error(10.1, 10.1, 10.3, "DEADLINE_EXCEEDED")  # 200 ms: past its deadline, the slowest query
    m = rec.finish()
    assert m.end_to_end.count == 1 and m.failed.count == 1
    every = m.every_query()
    assert every.count == 2 and every.summary()["max_us"] == pytest.approx(200_000, rel=1e-3)
    back = Measurement.from_wire(m.to_wire())
    assert back.failed == m.failed
    both = merge([m, back])
    assert both.failed.count == 2 and both.every_query().count == 4



def test_a_query_that_fails_before_its_deadline_counts_as_unanswered_until_then() -> None:
    """A shed or unavailable query fails in a millisecond: counted at that, it would make the tail of a
    run that fails 2% of its queries faster than one that answers them all. It got no answer, so it counts
    until its deadline (from its send: a late send moves it later); one failing past it, at its failure."""
    rec = Recorder(measure_from=0.0)
    for i in range(98):
        rec.ok(i * 0.01, i * 0.01, i * 0.01 + 0.005, [])
    rec.error(1.0, 1.0, 1.001, "RESOURCE_EXHAUSTED")  # 1 ms
    rec.error(2.0, 2.003, 2.004, "UNAVAILABLE")  # sent 3 ms late, failed 1 ms later
    m = rec.finish(deadline_s=0.5)
    assert m.failed.summary()["min_us"] == pytest.approx(500_000, rel=1e-3)
    assert m.failed.summary()["max_us"] == pytest.approx(503_000, rel=1e-3)
    assert m.every_query().percentile_us(99) == pytest.approx(500_000, rel=1e-3)  # not 5 ms
    assert m.end_to_end.percentile_us(99) == pytest.approx(5000, rel=1e-3)
    late = Recorder(measure_from=0.0)
    late.error(0.0, 0.0, 0.7, "DEADLINE_EXCEEDED")
    assert late.finish(deadline_s=0.5).failed.summary()["max_us"] == pytest.approx(700_000, rel=1e-3)
    assert rec.finish().failed.summary()["min_us"] == pytest.approx(1000, rel=1e-3)  # no deadline: as it failed
    # An SLO step (querygen's search and characterize's) judges every query: 2 of 100 unanswered miss 5 ms.
    step = SloStep.of(100.0, 98.0, m)
    assert step.p99_us == pytest.approx(500_000, rel=1e-3) and step.errors == 2 and step.queries == 100
    assert not step.meets(5000, 0.05, 0.9)



def test_the_achieved_rate_counts_answered_queries_only() -> None:
    """A server that fails 2 of 10 queries fast achieves 8 a second, not 10."""
    rec = Recorder(measure_from=0.0)
    for i in range(8):
        rec.ok(i * 0.1, i * 0.1, i * 0.1 + 0.005, [])
    rec.error(0.8, 0.8, 0.801, "RESOURCE_EXHAUSTED")
    rec.error(0.9, 0.9, 0.901, "UNAVAILABLE")
    assert achieved_rate(rec.finish(deadline_s=0.5), 0.0, 1.0) == pytest.approx(8.0)


def _queue(capacity: float, base_us: float = 2000.0):  # type: ignore[no-untyped-def]
    """A synthetic server: p99 grows like an M/M/1 queue's as the rate nears ``capacity``."""
    calls: list[float] = []

    async def measure(rate: float) -> SloStep:
        calls.append(rate)
        rho = rate / capacity
        p99 = base_us * 4.6 / (1 - rho) if rho < 1 else math.inf
        achieved = min(rate, capacity)
        return SloStep(rate, achieved, base_us / (1 - min(rho, 0.999)), p99, p99 * 1.5, 1000, 0)

    return measure, calls


def test_slo_search_brackets_then_bisects_to_the_knee() -> None:
    measure, calls = _queue(capacity=1000.0)
    # p99 <= 50 ms  <=>  9.2 ms / (1 - rho) <= 50 ms  <=>  rate <= 816 q/s
    search = SloSearch(slo_p99_us=50_000, start_rate=100, tolerance=0.02, max_steps=20)
    result = asyncio.run(find_max_rate(search, measure))
    knee = 1000 * (1 - 2000 * 4.6 / 50_000)
    assert result.max_rate is not None
    assert knee * 0.97 <= result.max_rate <= knee
    assert calls[:4] == [100, 200, 400, 800] and calls[4] == 1600  # bracket by doubling
    assert len(result.curve) == len(calls)
    rates = [c["target_rate"] for c in result.curve]
    assert rates == sorted(rates)
    assert all(c["meets_slo"] == (c["target_rate"] <= knee) for c in result.curve)


def test_slo_search_halves_down_and_reports_none_when_nothing_passes() -> None:
    measure, calls = _queue(capacity=100.0)
    result = asyncio.run(find_max_rate(SloSearch(slo_p99_us=50_000, start_rate=400), measure))
    assert calls[:3] == [400, 200, 100] and result.max_rate is not None and result.max_rate < 100
    measure, _ = _queue(capacity=100.0, base_us=100_000)  # even an idle server misses the SLO
    result = asyncio.run(find_max_rate(SloSearch(slo_p99_us=50_000, start_rate=10, min_rate=1), measure))
    assert result.max_rate is None and all(not c["meets_slo"] for c in result.curve)


def test_slo_step_fails_on_errors_or_an_undelivered_rate() -> None:
    ok = SloStep(100, 100, 1000, 2000, 3000, 1000, 0)
    assert ok.meets(5000, 0.01, 0.95)
    assert not SloStep(100, 100, 1000, 2000, 3000, 1000, 20).meets(5000, 0.01, 0.95)
    assert not SloStep(100, 80, 1000, 2000, 3000, 1000, 0).meets(5000, 0.01, 0.95)
    assert not SloStep(100, 0, 0, 0, 0, 0, 0).meets(5000, 0.01, 0.95)


def test_top_n_orders_by_score() -> None:
    # the per-component path runs the gateway's own Chain (tests/unit/test_chain.py), top_n included
    from recpipe.gateway.chain import top_n

    ids = np.arange(100, 110, dtype=np.int64)
    scores = np.random.default_rng(0).random(10).astype(np.float32)
    assert top_n(ids, scores, 3)[0].tolist() == ids[np.argsort(-scores)[:3]].tolist()
    assert top_n(ids, scores, 50)[0].shape == (10,) and top_n(ids[:0], scores[:0], 5)[0].shape == (0,)
