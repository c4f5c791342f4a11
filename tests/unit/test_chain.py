"""``Chain`` with in-process stage clients: the order of the hops, the sizes it resolves, the deadline
it passes on, the timings it returns and the errors it keeps."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from recpipe.config import STEPS, TOTAL_STEP
from recpipe.errors import BadRequest, DeadlineExceeded, Overloaded
from recpipe.gateway.chain import Chain
from recpipe.types import StageResult

ITEMS = 50


class Features:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    async def augment_user(self, user_id: int, timeout: float | None) -> StageResult[int]:
        self.calls.append(("augment_user", timeout))
        return StageResult(user_id, 11, queue_us=1, compute_us=9, batch_size=1)

    async def augment_items(self, user_id: int, item_ids: np.ndarray, timeout: float | None) -> StageResult[np.ndarray]:
        self.calls.append(("augment_items", item_ids.copy()))
        return StageResult(item_ids.astype(np.float32), 13, queue_us=3, compute_us=8, batch_size=4)


class Retrieval:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.ks: list[int] = []

    async def retrieve(self, user: int, k: int, timeout: float | None) -> StageResult[np.ndarray]:
        if self.fail is not None:
            raise self.fail
        self.ks.append(k)
        k = k or min(500, ITEMS)  # the stage's default
        if k > ITEMS:
            raise BadRequest(f"k must be <= the item count {ITEMS}, got {k}")
        ids = (np.arange(k, dtype=np.int64) * 7 + user) % ITEMS
        return StageResult(ids, 17, "v9", queue_us=5, compute_us=10, batch_size=2)


class Ranking:
    async def rank(self, user: int, items: np.ndarray, timeout: float | None) -> StageResult[np.ndarray]:
        return StageResult(items / ITEMS, 19, "v9", queue_us=7, compute_us=11, batch_size=8)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_chain_calls_the_stages_in_order_and_returns_the_top_n() -> None:
    features, retrieval = Features(), Retrieval()
    chain = Chain(features, retrieval, Ranking())
    rec = run(chain.recommend(3, 20, 5, deadline=time.monotonic() + 10))
    assert [c[0] for c in features.calls] == ["augment_user", "augment_items"]
    candidates = features.calls[1][1]
    assert isinstance(candidates, np.ndarray) and candidates.shape == (20,)
    # ranking scores each item by its id: the top 5 are the 5 largest candidate ids, best first
    assert rec.item_ids.tolist() == sorted(candidates.tolist(), reverse=True)[:5]
    assert (np.diff(rec.scores) <= 0).all() and rec.model_version == "v9"
    assert [t.stage for t in rec.timings] == [*STEPS, TOTAL_STEP]
    rank = rec.timing("rank")
    assert (rank.server_us, rank.queue_us, rank.compute_us, rank.batch_size) == (19, 7, 11, 8)
    assert rec.timing("retrieve").batch_size == 2
    assert all(t.observed_us >= 0 for t in rec.timings)
    # every hop got the time left, below the 10 s the caller had
    timeout = features.calls[0][1]
    assert isinstance(timeout, float) and 0 < timeout <= 10


def test_default_candidates_are_left_to_retrieval() -> None:
    retrieval = Retrieval()
    rec = run(Chain(Features(), retrieval, Ranking()).recommend(1))
    assert retrieval.ks == [0]  # 0 = the stage's default (here the whole 50-item catalogue)
    assert rec.item_ids.shape == (10,)


@pytest.mark.parametrize(
    ("k", "n", "message"),
    [(-1, 0, "num_candidates must be >= 0"), (10_001, 0, "<= 10000"), (5, 6, "num_results (6) must be <= "
                                                                              "num_candidates (5)"),
     (0, 501, "num_results (501) must be <= num_candidates (500)"), (5, -1, "num_results must be >= 0")],
)
def test_bad_sizes_fail_before_any_stage_is_called(k: int, n: int, message: str) -> None:
    features = Features()
    with pytest.raises(BadRequest) as info:
        run(Chain(features, Retrieval(), Ranking()).recommend(1, k, n))
    assert message in str(info.value)
    assert features.calls == []


def test_the_retrieval_stage_owns_the_catalogue_bound() -> None:
    with pytest.raises(BadRequest, match=f"item count {ITEMS}"):
        run(Chain(Features(), Retrieval(), Ranking()).recommend(1, ITEMS + 1, 5))


def test_errors_keep_their_kind_and_deadlines_are_enforced() -> None:
    with pytest.raises(Overloaded, match="retrieval"):
        run(Chain(Features(), Retrieval(Overloaded("retrieval: queue full")), Ranking()).recommend(1, 10, 5))
    with pytest.raises(DeadlineExceeded):
        run(Chain(Features(), Retrieval(), Ranking()).recommend(1, 10, 5, deadline=time.monotonic() - 1))


def test_gateway_admission_bounds_calls_in_flight_and_refuses_what_the_deadline_cannot_cover() -> None:
    from recpipe.gateway.admission import HEADROOM, Admission

    now = [100.0]
    a = Admission(max_in_flight=3, clock=lambda: now[0])
    for _ in range(3):
        a.admit(None)
    with pytest.raises(Overloaded, match="3 requests in flight"):
        a.admit(None)
    for _ in range(3):
        a.release(now[0], completed=True)
    assert a.measured(now[0]) is None  # 3 completions: too few to trust, so only the bound applies
    a.admit(now[0] + 1e-6)
    for _ in range(17):  # 20 completions in the last second: 3 at once, 17 of 50 ms each
        started = a.admit(None)
        now[0] += 0.05
        a.release(started, completed=True)
    rate, took = a.measured(now[0])
    assert rate == 20 and took == pytest.approx(17 * 0.05 / 20)
    # the one call in flight leaves a new one less than 1 ms of a deadline it would need 55 ms of
    with pytest.raises(Overloaded, match=f"less than {HEADROOM:g}x that"):
        a.admit(now[0] + 1e-3)


def test_gateway_admission_expects_the_service_time_at_low_load_and_the_drain_time_under_overload() -> None:
    from recpipe.gateway.admission import HEADROOM, Admission

    now = [100.0]
    a = Admission(max_in_flight=512, clock=lambda: now[0])
    for _ in range(25):  # 25 calls of 16 ms each in the last second: a lightly loaded chain
        started = a.admit(None)
        now[0] += 0.016
        a.release(started, completed=True)
    now[0] += 0.5
    rate, took = a.measured(now[0])
    assert rate == 25 and took == pytest.approx(0.016)
    a.admit(None)  # one call in flight: a second one hardly waits, so a 100 ms deadline is plenty
    assert a.expected_s(now[0]) == pytest.approx(0.016 * 2 / 1.4)
    a.admit(now[0] + 0.1)
    # under overload: 60 calls in flight at 25/s: draining them takes ~2.4 s
    for _ in range(58):
        a.admit(None)
    assert a.expected_s(now[0]) == pytest.approx(0.016 * 61 / 1.4)
    with pytest.raises(Overloaded, match=f"less than {HEADROOM:g}x that"):
        a.admit(now[0] + HEADROOM * a.expected_s(now[0]) * 0.9)
    a.admit(now[0] + HEADROOM * a.expected_s(now[0]) * 1.1)


def test_gateway_admission_keeps_the_last_figures_when_completions_stop() -> None:
    """Under overload completions can stop altogether; the old fallback ("too few to trust: admit up to
    --max-in-flight") then let everything in, every call expired, and completions stayed at zero."""
    from recpipe.gateway.admission import Admission

    now = [100.0]
    a = Admission(max_in_flight=512, clock=lambda: now[0])
    for _ in range(20):
        started = a.admit(None)
        now[0] += 0.02
        a.release(started, completed=True)
    trusted = a.measured(now[0])
    assert trusted is not None
    for _ in range(20):
        a.admit(None)  # in flight, never completing
    now[0] += 10.0  # nothing completed for 10 s
    assert a.measured(now[0]) == trusted
    with pytest.raises(Overloaded):
        a.admit(now[0] + 0.1)


def test_the_chain_counts_the_queries_that_have_yet_to_reach_each_step() -> None:
    """``Chain.ahead``: what a batched hop waits for (``--hop-upstream-wait-us``). Each query counts at
    every step until it reaches it; one that fails stops counting at the steps it will never reach, and
    each step's ``on_pass`` hears of every change."""

    class Held(Ranking):
        def __init__(self) -> None:
            self.gate = asyncio.Event()

        async def rank(self, user: int, items: np.ndarray, timeout: float | None) -> StageResult[np.ndarray]:
            await self.gate.wait()
            return await super().rank(user, items, timeout)

    async def go() -> None:
        ranking = Held()
        chain = Chain(Features(), Retrieval(), ranking)
        passed = [0] * len(STEPS)
        for step in range(len(STEPS)):
            chain.on_pass[step] = lambda step=step: passed.__setitem__(step, passed[step] + 1)  # type: ignore[misc]
        queries = [asyncio.create_task(chain.recommend(u, 10, 3)) for u in range(3)]
        await asyncio.sleep(0.01)
        assert chain.ahead == [0, 0, 0, 0] and passed == [3, 3, 3, 3]  # all three held at the ranking step
        ranking.gate.set()
        await asyncio.gather(*queries)
        failing = Chain(Features(), Retrieval(fail=Overloaded("busy")), Ranking())
        with pytest.raises(Overloaded):
            await failing.recommend(1, 10, 3)
        assert failing.ahead == [0, 0, 0, 0]  # it left the steps after retrieval uncounted
        with pytest.raises(BadRequest):
            await failing.recommend(1, 5, 10)  # refused before any step: never counted
        assert failing.ahead == [0, 0, 0, 0] and chain.ahead == [0, 0, 0, 0]

    run(go())
