"""Sender processes, their pure parts: the schedule split, the exact merge of what each process measured,
the auto sizing and the settings (no process is started here; tests/integration/test_querygen_processes.py
starts them)."""

from __future__ import annotations

import numpy as np
import pytest

from recpipe.config import STEPS, TOTAL_STEP
from recpipe.errors import UsageError
from recpipe.querygen import loops, senders
from recpipe.querygen.config import AUTO, QuerygenConfig, parse_processes
from recpipe.querygen.histogram import LatencyHistogram
from recpipe.querygen.recorder import Measurement, Recorder, merge
from recpipe.querygen.session import Step, generator_block
from recpipe.querygen.workload import ArrivalIntervals, fixed_candidates, open_schedule, parse_lognormal


def _outcomes(n: int, seed: int) -> list[tuple[float, float, float, str, list[tuple[str, int, int, int, int, int]]]]:
    """``n`` seeded query outcomes: (scheduled, sent, done, status, timings), some late, some failed."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        scheduled = 1.0 + i * 0.001
        sent = scheduled + float(rng.exponential(0.0004))
        done = sent + float(rng.lognormal(np.log(0.004), 0.7))
        status = "OK" if i % 17 else ("UNAVAILABLE" if i % 2 else "DEADLINE_EXCEEDED")
        timings = [(stage, int(rng.integers(10, 5000)), int(rng.integers(10, 6000)), int(rng.integers(0, 100)),
                    int(rng.integers(10, 4000)), int(rng.integers(1, 9))) for stage in STEPS]
        timings.append((TOTAL_STEP, int(rng.integers(100, 9000)), int(rng.integers(100, 9000)), 0, 0, 0))
        out.append((scheduled, sent, done, status, timings))
    return out


def _record(rec: Recorder, outcome: tuple) -> None:  # type: ignore[type-arg]
    scheduled, sent, done, status, timings = outcome
    if status == "OK":
        rec.ok(scheduled, sent, done, timings)
    else:
        rec.error(scheduled, sent, done, status)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_the_merge_of_every_process_equals_one_recorder_of_all_samples(n: int) -> None:
    outcomes = _outcomes(3000, seed=n)
    measure_from = 1.2  # the first 200 are warm-up
    whole = Recorder(measure_from)
    parts = [Recorder(measure_from) for _ in range(n)]
    for i, outcome in enumerate(outcomes):
        _record(whole, outcome)
        _record(parts[i % n], outcome)  # process k's share of the schedule
    expected = whole.finish()
    # Through the wire, as the parent receives them from its senders.
    merged = merge([Measurement.from_wire(p.finish().to_wire()) for p in parts])

    assert merged.end_to_end == expected.end_to_end and merged.send_lag == expected.send_lag
    assert set(merged.stages) == set(expected.stages)
    for stage, h in expected.stages.items():
        got = merged.stages[stage]
        assert (got.observed, got.server, got.queue, got.compute) == (h.observed, h.server, h.queue, h.compute)
        assert sorted(got.batch_sizes) == sorted(h.batch_sizes)
        assert got.batch_summary() == h.batch_summary()
    assert merged.end_to_end.summary() == expected.end_to_end.summary()
    assert merged.end_to_end.cdf() == expected.end_to_end.cdf()
    # Counts add up.
    assert (merged.ok, merged.errors, merged.warmup_queries, merged.late_sends) == (
        expected.ok, expected.errors, expected.warmup_queries, expected.late_sends)
    assert merged.queries == expected.queries == 2800 and merged.warmup_queries == 200
    assert (merged.first_scheduled, merged.last_done, merged.measure_from) == (
        expected.first_scheduled, expected.last_done, expected.measure_from)


def test_histogram_wire_form_is_lossless_and_empty_ones_survive() -> None:
    h = LatencyHistogram()
    h.record_many_us(np.random.default_rng(0).lognormal(8, 1.5, 5000))
    assert LatencyHistogram.from_wire(h.to_wire()) == h
    assert LatencyHistogram.from_wire(LatencyHistogram().to_wire()) == LatencyHistogram()
    other = LatencyHistogram()
    other.record_us(7)
    assert other != h


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_the_open_loop_split_holds_every_query_of_the_schedule_exactly_once(n: int) -> None:
    arrivals = open_schedule(1000.0, 0.5, 2.0, seed=4)
    shares = [senders.open_share(arrivals, k, n) for k in range(n)]
    indices = np.concatenate([np.asarray(idx) for idx, _ in shares])
    assert sorted(indices.tolist()) == list(range(len(arrivals)))  # each query once
    for idx, times in shares:
        assert len(idx) == len(times)
        assert np.array_equal(arrivals[np.asarray(idx, dtype=np.int64)], times)  # at its own instant
        assert np.all(np.diff(times) >= 0)
    # the union, in time order, is the one-process schedule
    union = np.sort(np.concatenate([times for _, times in shares]))
    assert np.array_equal(union, arrivals)
    # and each share runs over the whole schedule (not a block of it)
    assert all(times[0] < 0.05 and times[-1] > 2.4 for _, times in shares)


def test_open_jobs_carry_the_share_as_plain_data() -> None:
    arrivals = open_schedule(300.0, 0.0, 1.0, seed=1)
    jobs = [senders.open_job(arrivals, 0.0, k, 3) for k in range(3)]
    assert all(isinstance(j["arrivals"], list) for j in jobs)
    rebuilt = sorted((j["first"] + j["step"] * i, t) for j in jobs for i, t in enumerate(j["arrivals"]))
    assert [i for i, _ in rebuilt] == list(range(300)) and [t for _, t in rebuilt] == arrivals.tolist()


@pytest.mark.parametrize(("total", "n"), [(1, 1), (4, 3), (5, 5), (64, 6), (100, 7)])
def test_closed_loop_shares_add_up(total: int, n: int) -> None:
    shares = [senders.closed_share(total, k, n) for k in range(n)]
    assert sum(shares) == total and max(shares) - min(shares) <= 1 and min(shares) >= 1
    jobs = [senders.closed_job(total, 0.1, None, 1000, k, n) for k in range(n)]
    assert sum(j["concurrency"] for j in jobs) == total and sum(j["queries"] for j in jobs) == 1000
    # process k draws queries k, k + n, ...: disjoint parts of one stream
    drawn = [{j["first"] + j["step"] * i for i in range(50)} for j in jobs]
    assert sum(len(d) for d in drawn) == len(set().union(*drawn))


def test_closed_loop_processes_draw_disjoint_queries() -> None:
    seen: list[int] = []

    async def send(i: int) -> loops.Outcome:
        seen.append(i)
        return "OK", ()

    for k in range(3):
        loops.run(loops.run_closed(send, 2, 0.0, queries=20, index_start=k, index_step=3))
    assert len(seen) == 60 and len(set(seen)) == 60 and all(i % 3 in (0, 1, 2) for i in seen)


def test_auto_sizes_from_the_offered_load_and_the_cores() -> None:
    rate = senders.PROCESS_RATE
    assert senders.plan(AUTO, "open", 0.5 * rate, 1, cores=16)[0] == 1
    assert senders.plan(AUTO, "open", 2.5 * rate, 1, cores=16)[0] == 3
    n, why = senders.plan(AUTO, "open", 100 * rate, 1, cores=4)
    assert n == 4 and "capped" in why
    assert senders.plan(AUTO, "closed", 1, 3 * senders.CLIENTS_PER_PROCESS, cores=16)[0] == 3
    assert senders.plan(AUTO, "closed", None, 1, cores=16)[0] == 1
    assert senders.plan(AUTO, "sequential", None, 1, cores=16)[0] == 1
    assert senders.plan(5, "open", 1.0, 1, cores=2) == (5, "--processes 5")  # as asked, even past the cores


@pytest.mark.parametrize("text", ["0", "-1", "abc", "1.5", "65", ""])
def test_bad_process_counts_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError, match="--processes"):
        parse_processes(text)
    assert parse_processes(" Auto ") == AUTO and parse_processes("3") == 3


def _config(**kw: object) -> QuerygenConfig:
    kw.setdefault("candidates", fixed_candidates(50))
    return QuerygenConfig(target="127.0.0.1:1", **kw)  # type: ignore[arg-type]


def test_config_refuses_what_cannot_be_split() -> None:
    with pytest.raises(UsageError, match="sequential sends one query at a time"):
        _config(mode="sequential", processes=2)
    with pytest.raises(UsageError, match="more than --concurrency 2"):
        _config(mode="closed", concurrency=2, processes=3)
    with pytest.raises(UsageError, match="--processes"):
        _config(mode="open", rate=10.0, processes=0)
    # auto is fine everywhere: it sizes itself per run
    assert _config(mode="sequential", processes=AUTO).processes == AUTO
    assert _config(mode="closed", concurrency=4, processes="Auto").processes == AUTO
    assert _config(mode="closed", concurrency=4, processes="3").processes == 3


def test_config_travels_to_a_sender_as_plain_data() -> None:
    config = _config(mode="open", candidates=parse_lognormal("lognormal:200,0.5"),
                     arrivals=ArrivalIntervals((0.001, 0.002), "f.txt"), users="zipf", processes=3, num_users=77)
    wire = senders.config_to_wire(config)
    assert isinstance(wire["candidates"], dict) and isinstance(wire["arrivals"], dict)
    assert senders.config_from_wire(wire) == config
    plain = _config(mode="closed", concurrency=4, processes=AUTO)
    assert senders.config_from_wire(senders.config_to_wire(plain)) == plain


def test_generator_block_keeps_each_process_send_lag() -> None:
    parts = []
    for k, lag_s in enumerate((0.0001, 0.003)):
        rec = Recorder(0.0)
        for i in range(200):
            rec.ok(i * 0.01, i * 0.01 + lag_s, i * 0.01 + 0.005, [])
        parts.append(senders.SenderResult(k, rec.finish(), 0.2))
    step = Step(merge([p.measurement for p in parts]), 2.0, parts, "--processes 2")
    block = generator_block(_config(mode="open", rate=100.0, processes=2), [step])
    assert block["processes"] == 2 and block["sender_cpu_s"] == pytest.approx(0.4)
    rows = block["senders"]
    assert [r["process"] for r in rows] == [0, 1] and [r["queries"] for r in rows] == [200, 200]
    assert rows[0]["send_lag"]["p99_us"] == pytest.approx(100, rel=0.01)
    assert rows[1]["send_lag"]["p99_us"] == pytest.approx(3000, rel=0.01)
    assert rows[1]["send_lag"]["late_over_1ms"] == 200 and rows[0]["cpu_us_per_query"] == pytest.approx(1000)
