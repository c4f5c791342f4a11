"""The dynamic batcher on a real event loop with a real worker thread: batching, the split of the
time, admission (queue bound, deadline), dropping expired and cancelled requests, shutdown, and where a
core call runs (inline on the loop only when it is predicted short)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from recpipe.errors import BadRequest, DeadlineExceeded, Overloaded, StageUnavailable, UsageError
from recpipe.serving.batcher import BatchConfig, Batcher
from recpipe.serving.inline import INLINE_MAX_S, CallCost


class Core:
    """Doubles each query; records the batches it ran; can be held at a gate or slowed down."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.threads: list[str] = []  # the thread each batch ran on
        self.delay_s = delay_s
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, queries: Sequence[int]) -> list[int | BaseException]:
        self.gate.wait(10)
        if self.delay_s:
            time.sleep(self.delay_s)
        self.batches.append(list(queries))
        self.threads.append(threading.current_thread().name)
        return [BadRequest(f"bad {q}") if q < 0 else 2 * q for q in queries]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_concurrent_requests_share_one_core_call_and_get_their_own_answers() -> None:
    core = Core()

    async def go() -> list:
        b = Batcher("rank", core, BatchConfig(max_batch=8))
        core.gate.clear()  # the first request occupies the core while the others queue behind it
        first = asyncio.create_task(b.submit(100))
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(b.submit(i)) for i in range(8)]
        await asyncio.sleep(0.05)
        core.gate.set()
        out = await asyncio.gather(first, *rest)
        await b.close()
        return out

    first, *rest = run(go())
    assert first.value == 200 and first.batch_size == 1
    assert [r.value for r in rest] == [2 * i for i in range(8)]
    assert core.batches == [[100], list(range(8))]
    assert {r.batch_size for r in rest} == {8}
    assert all(r.queue_us >= 40_000 and r.compute_us >= 0 for r in rest)  # waited behind the first call


def test_max_batch_splits_the_queue_and_one_failure_stays_with_its_request() -> None:
    core = Core()

    async def go() -> list:
        b = Batcher("rank", core, BatchConfig(max_batch=3, max_queue=16))
        core.gate.clear()
        tasks = [asyncio.create_task(b.submit(i)) for i in (1, 2, -3, 4, 5, 6, 7)]
        await asyncio.sleep(0.05)
        core.gate.set()
        out = await asyncio.gather(*tasks, return_exceptions=True)
        await b.close()
        return out

    out = run(go())
    assert isinstance(out[2], BadRequest)
    assert [o.value for i, o in enumerate(out) if i != 2] == [2, 4, 8, 10, 12, 14]
    assert max(len(b) for b in core.batches) == 3


def test_queue_delay_waits_for_a_fuller_batch() -> None:
    core = Core()

    async def go() -> None:
        b = Batcher("rank", core, BatchConfig(max_batch=4, max_queue_delay_us=200_000))
        t = [asyncio.create_task(b.submit(1))]
        await asyncio.sleep(0.02)
        t += [asyncio.create_task(b.submit(i)) for i in (2, 3, 4)]
        await asyncio.gather(*t)
        await b.close()

    run(go())
    assert core.batches == [[1, 2, 3, 4]]  # the full batch went at once, before the 200 ms delay ran out


def test_a_full_queue_is_refused_at_once_with_resource_exhausted() -> None:
    core = Core()

    async def go() -> list:
        b = Batcher("ranking.Rank", core, BatchConfig(max_batch=1, max_queue=2))
        core.gate.clear()
        running = asyncio.create_task(b.submit(0))
        await asyncio.sleep(0.05)
        queued = [asyncio.create_task(b.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0.01)
        # "at once": the refusal comes from submit's first step, before it yields to the loop or waits
        # on the core, which is still held at its gate with the first request
        refused = b.submit(3)
        with pytest.raises(Overloaded, match=r"ranking.Rank: queue full \(2 requests waiting\)"):
            refused.send(None)
        assert not running.done() and b.queued == 2
        core.gate.set()
        out = await asyncio.gather(running, *queued)
        await b.close()
        return out

    out = run(go())
    assert [o.value for o in out] == [0, 2, 4]
    assert 3 not in [q for batch in core.batches for q in batch]  # no work done for the refused request


def test_a_batch_calls_entries_count_against_the_queue_and_the_expected_wait_of_the_ones_after_them() -> None:
    core = Core(delay_s=0.05)

    async def go() -> None:
        b = Batcher("features.AugmentItems", core, BatchConfig(max_batch=1, max_queue=4))
        # a group of 6 on an empty queue: 4 fit the queue, the last 2 are refused, each alone
        out = await b.submit_many(list(range(6)), [None] * 6)
        assert [o.value for o in out[:4]] == [0, 2, 4, 6]  # type: ignore[union-attr]
        assert all(isinstance(o, Overloaded) and "queue full" in str(o) for o in out[4:])
        assert core.batches[-1] == [0, 1, 2, 3]  # the admitted ones as one core call, the refused ones never
        # each entry waits behind the group's entries before it: with 2.5 service times left, the first
        # two fit and the next are refused (RESOURCE_EXHAUSTED, not taken in and answered late)
        service_s = b.request_s
        deadline = time.monotonic() + 2.5 * service_s
        out = await b.submit_many([10, 11, 12, 13], [deadline] * 4)
        assert not isinstance(out[0], Exception) and not isinstance(out[1], Exception)
        assert all(isinstance(o, Overloaded) for o in out[2:])
        await b.close()

    run(go())


def test_a_deadline_shorter_than_the_expected_wait_is_refused() -> None:
    core = Core(delay_s=0.05)

    async def go() -> None:
        b = Batcher("retrieval.Retrieve", core, BatchConfig(max_batch=1))
        await b.submit(1)  # teaches the batcher its service time (at least the core's 50 ms)
        service_s = b.request_s
        assert service_s >= 0.05
        # idle: half the service time is too short for the stage at all
        with pytest.raises(DeadlineExceeded, match="less than the stage's recent service time"):
            await b.submit(2, deadline=time.monotonic() + service_s / 2)
        # busy: 1.5x the service time would do alone, but not behind a running request
        core.gate.clear()
        running = asyncio.create_task(b.submit(3))
        await asyncio.sleep(0.005)
        with pytest.raises(Overloaded, match="ms left of the deadline"):
            await b.submit(2, deadline=time.monotonic() + 1.5 * service_s)
        core.gate.set()
        await running
        with pytest.raises(DeadlineExceeded):
            await b.submit(2, deadline=time.monotonic() - 0.001)
        assert (await b.submit(3, deadline=time.monotonic() + 60)).value == 6
        await b.close()

    run(go())


def test_the_estimate_is_per_request_so_an_idle_stage_admits_again_after_big_batches() -> None:
    core = Core(delay_s=0.2)

    async def go() -> None:
        b = Batcher("rank", core, BatchConfig(max_batch=8, max_queue_delay_us=50_000))
        out = await asyncio.gather(*(b.submit(i) for i in range(8)))  # one batch of 8
        assert core.batches == [list(range(8))]
        batch_s = out[0].compute_us / 1e6
        assert b.request_s == pytest.approx(batch_s / 8, rel=0.01, abs=2e-6)  # per request, not per batch
        core.delay_s = 0.0
        # a lone request with 3/4 of the batch's time left fits: a per-batch estimate would refuse it for good
        assert (await b.submit(9, deadline=time.monotonic() + 0.75 * batch_s)).value == 18
        await b.close()

    run(go())


def test_a_request_that_expires_in_the_queue_is_dropped_before_any_work() -> None:
    core = Core()

    async def go() -> None:
        b = Batcher("rank", core, BatchConfig(max_batch=1))
        core.gate.clear()
        running = asyncio.create_task(b.submit(0))
        await asyncio.sleep(0.02)
        doomed = asyncio.create_task(b.submit(1, deadline=time.monotonic() + 0.05))
        await asyncio.sleep(0.1)
        core.gate.set()
        await running
        with pytest.raises(DeadlineExceeded, match="while queued"):
            await doomed
        await b.close()

    run(go())
    assert core.batches == [[0]]


def test_a_cancelled_request_frees_its_slot_and_is_never_computed() -> None:
    core = Core()

    async def go() -> None:
        b = Batcher("rank", core, BatchConfig(max_batch=1, max_queue=1))
        core.gate.clear()
        running = asyncio.create_task(b.submit(0))
        await asyncio.sleep(0.02)
        waiting = asyncio.create_task(b.submit(1))
        await asyncio.sleep(0.01)
        assert b.queued == 1
        waiting.cancel()
        await asyncio.sleep(0)
        assert b.queued == 0
        again = asyncio.create_task(b.submit(2))  # the slot is free again
        await asyncio.sleep(0.01)
        core.gate.set()
        assert (await running).value == 0 and (await again).value == 4
        await b.close()

    run(go())
    assert core.batches == [[0], [2]]


def test_close_fails_queued_requests_with_unavailable() -> None:
    core = Core()

    async def go() -> None:
        b = Batcher("ranking.Rank", core, BatchConfig(max_batch=1))
        core.gate.clear()
        running = asyncio.create_task(b.submit(0))
        await asyncio.sleep(0.02)
        queued = asyncio.create_task(b.submit(1))
        await asyncio.sleep(0.01)
        await b.close()
        core.gate.set()
        for task in (running, queued):  # neither hangs: both are answered, naming the stage
            with pytest.raises(StageUnavailable, match=r"ranking\.Rank"):
                await task
        with pytest.raises(StageUnavailable):
            await b.submit(2)

    run(go())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_batch": -1}, r"--max-batch must be >= 0 \(0 = auto\)"), ({"max_queue_delay_us": -1}, "--max-queue-delay-us must be >= 0"),
     ({"max_batch": 8, "max_queue": 4}, r"--max-queue \(4\) must be >= --max-batch \(8\)")],
)
def test_bad_knobs_are_usage_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        BatchConfig(**kwargs)


def test_max_batch_zero_means_32_on_a_gpu_and_1_on_a_cpu() -> None:
    auto = BatchConfig()
    assert auto.max_batch == 0
    assert auto.for_device("cpu").max_batch == 1
    assert auto.for_device("cuda:0 (NVIDIA H100 80GB HBM3)").max_batch == 32
    assert BatchConfig(max_batch=8).for_device("cpu").max_batch == 8  # an explicit size is kept


def test_a_lone_inline_request_runs_at_once_without_the_worker() -> None:
    """Batching off, inline calls, nothing ahead, a short call predicted: the request runs in ``submit``
    itself (no worker task, no loop turns), with the same answer, errors and service-time learning as
    through the queue. The first call has no prediction yet, so it goes through the worker to the
    batcher's thread."""
    core = Core()

    async def go() -> None:
        b = Batcher("rank", core, BatchConfig(max_batch=1), inline=True)
        first = await b.submit(1)  # no estimate yet: the thread
        assert (first.value, first.batch_size) == (2, 1) and b._worker is not None
        assert b.cost.row_s is not None and b.cost.short(1)
        loop_thread = threading.current_thread().name
        worker, b._worker = b._worker, None
        done = await b.submit(21)
        assert (done.value, done.queue_us, done.batch_size) == (42, 0, 1)
        assert b._worker is None and b.batches == 2 and b.request_s > 0  # no worker needed for it
        with pytest.raises(BadRequest, match="bad -1"):
            await b.submit(-1)
        assert core.threads[1:] == [loop_thread, loop_thread]
        b._worker = worker
        await b.close()

    run(go())
    assert core.batches == [[1], [21], [-1]]
    assert core.threads[0].startswith("rank-core")


def test_a_lone_batch_call_group_runs_at_once_as_one_core_call() -> None:
    """``submit_many`` (a batch or stream message's entries) takes the same short cut as a lone request:
    the group runs in the call itself, as the one core call the worker would have made of it, each entry
    with its own answer or error and a refused entry left out; a failure of the whole core call is
    every entry's. With a request queued ahead, the group goes through the queue as before."""
    core = Core()

    async def go() -> None:
        b = Batcher("rank", core, BatchConfig(max_batch=1), inline=True)
        await b.submit(1)  # no estimate yet: the thread
        b.cost.max_rows = 10  # as if calls of up to 10 rows had been seen: 3 is predicted short
        loop_thread = threading.current_thread().name
        worker, b._worker = b._worker, None
        past = time.monotonic() - 1
        done = await b.submit_many([3, -1, 4, 5], [None, None, past, None])
        assert [d.value if not isinstance(d, Exception) else type(d) for d in done] == [6, BadRequest,
                                                                                     DeadlineExceeded, 10]
        assert [(d.queue_us, d.batch_size) for d in done if not isinstance(d, Exception)] == [(0, 3), (0, 3)]
        assert core.batches[-1] == [3, -1, 5] and core.threads[-1] == loop_thread and b._worker is None
        broken = Batcher("rank", lambda qs: [1], BatchConfig(max_batch=1), inline=True)
        broken.cost.row_s, broken.cost.max_rows = 1e-6, 10
        failed = await broken.submit_many([1, 2], [None, None])
        assert all(isinstance(f, RuntimeError) and "batch of 2 got 1" in str(f) for f in failed)
        await broken.close()
        b._worker = worker
        core.gate.clear()  # a call held on the thread: the group that comes meanwhile queues behind it
        b.cost.max_rows = 0  # no estimate for the held call's size: it goes to the thread
        held = asyncio.create_task(b.submit(7))
        while not b._running:
            await asyncio.sleep(0.001)
        b.cost.max_rows = 10
        behind = asyncio.create_task(b.submit_many([8, 9], [None, None]))
        await asyncio.sleep(0.01)
        assert not behind.done() and len(b._queue) == 2
        core.gate.set()
        assert (await held).value == 14
        assert [d.value for d in await behind] == [16, 18]  # type: ignore[union-attr]
        await b.close()

    run(go())


def test_an_inline_batcher_sends_calls_predicted_long_to_its_thread() -> None:
    """Inline allowed, but a call predicted longer than ``INLINE_MAX_S`` (from the seconds per row it
    learnt, times the call's rows) runs on the batcher's thread, and so does a call larger than any
    before it; the loop stays free meanwhile."""
    core = Core()

    async def go() -> None:
        b = Batcher("rank", core, BatchConfig(max_batch=4), inline=True, rows=lambda q: abs(q))
        await b.submit(10)  # first call: the thread
        # as if learnt: 100 rows fill the inline budget, and calls of up to 1000 rows were seen
        b.cost.row_s, b.cost.max_rows = INLINE_MAX_S / 100, 1000
        b.cost.call = lambda fn, arg, rows: fn(arg)  # type: ignore[method-assign]  # keep that estimate
        assert (await b.submit(50)).value == 100  # 50 rows, predicted half the budget: on the loop
        assert (await b.submit(200)).value == 400  # predicted twice the budget: the thread
        assert (await b.submit(1000)).value == 2000
        assert (await b.submit(2000)).value == 4000  # more rows than ever before: the thread
        # while a long call is held at the gate on the thread, the loop runs other work
        core.gate.clear()
        held = asyncio.create_task(b.submit(300))
        ticks = 0
        while not core.gate.is_set():
            await asyncio.sleep(0.001)
            ticks += 1
            if ticks == 20:
                assert not held.done() and [300] not in core.batches  # still held, and the loop ran
                core.gate.set()
        assert (await held).value == 600
        await b.close()

    run(go())
    loop_thread = threading.current_thread().name  # asyncio.run runs the loop on this thread
    assert core.threads[1] == loop_thread
    assert all(t.startswith("rank-core") for t in (core.threads[0], *core.threads[2:])), core.threads


def test_a_threaded_batcher_never_runs_inline() -> None:
    core = Core()

    async def go() -> None:
        b = Batcher("rank", core, BatchConfig(max_batch=1))
        for i in range(5):
            assert (await b.submit(i)).value == 2 * i
        assert b.cost.short(1)  # predicted short, but inline calls are not allowed
        await b.close()

    run(go())
    assert all(t.startswith("rank-core") for t in core.threads)


def test_call_cost_predicts_from_seconds_per_row_and_only_within_the_sizes_seen() -> None:
    cost = CallCost()
    assert cost.predict_s(1) is None and not cost.short(1)  # nothing learnt: not short
    cost.learn(0.002, 500)  # 4 µs per row
    assert cost.predict_s(250) == pytest.approx(0.001) and cost.short(500)
    assert cost.predict_s(501) is None and not cost.short(501)  # larger than any call so far
    cost.learn(0.2, 5000)  # 40 µs per row, in a call of 5000: the average moves a fifth of the way
    assert cost.row_s == pytest.approx(0.8 * 4e-6 + 0.2 * 40e-6)
    assert cost.max_rows == 5000 and not cost.short(5000) and cost.short(500)


def _spin(seconds: float) -> float:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
    return seconds


def test_call_cost_adds_up_the_cpu_its_calls_spent_on_the_threads_they_ran_on() -> None:
    cost = CallCost()
    assert cost.cpu_s == 0.0
    cost.call(_spin, 0.02, 1)  # inline: this thread
    assert 0.02 <= cost.cpu_s < 0.5
    cost.call(time.sleep, 0.05, 1)  # waiting is not computing
    assert cost.cpu_s < 0.02 + 0.02
    with ThreadPoolExecutor(1) as pool:  # on a core thread, as a batcher runs it
        pool.submit(cost.call, _spin, 0.02, 1).result()
    assert 0.04 <= cost.cpu_s < 0.5
    with pytest.raises(ZeroDivisionError):  # a call that raises still counts what it spent
        cost.call(lambda x: _spin(x) / 0, 0.01, 1)
    assert cost.cpu_s >= 0.05


def test_one_long_call_sends_the_next_ones_to_the_thread_until_the_average_recovers() -> None:
    cost = CallCost()
    for _ in range(5):
        cost.learn(0.005, 500)
    assert cost.short(500)
    cost.learn(3.0, 500)  # a stall (a compile, say) inside a call predicted short
    long_after = 0
    while not cost.short(500):
        cost.learn(0.005, 500)
        long_after += 1
    assert 10 <= long_after <= 40  # a few dozen calls on the thread, then inline again


def test_call_cost_learns_the_time_of_a_call_that_raises() -> None:
    cost = CallCost()

    def fail(_: int) -> int:
        raise BadRequest("no")

    with pytest.raises(BadRequest):
        cost.call(fail, 1, 3)
    assert cost.row_s is not None and cost.max_rows == 3
