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
    from recpipe.gateway.admission import Admission

    a = Admission(max_in_flight=3)
    for _ in range(3):
        a.admit(None)
    with pytest.raises(Overloaded, match="3 requests in flight"):
        a.admit(None)
    for _ in range(3):
        a.release(completed=True)
    # a measured rate: 20 completions in the last second, 2 calls in flight -> ~100 ms to complete
    for _ in range(17):
        a.admit(None)
        a.release(completed=True)
    a.admit(None)
    a.admit(None)
    assert a.rate(time.monotonic()) == 20
    with pytest.raises(Overloaded, match="more than the"):
        a.admit(time.monotonic() + 0.05)
    a.admit(time.monotonic() + 0.5)  # enough time left: admitted
    assert a.in_flight == 3
