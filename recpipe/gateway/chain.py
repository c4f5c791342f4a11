"""The Recommend chain: AugmentUser -> Retrieve -> AugmentItems -> Rank -> top ``num_results``.

The chain knows only its three stage clients (passed in, Ray Serve style) and arrays from
``recpipe.types``; whether a client crosses gRPC (``recpipe.gateway.clients``) or calls a core in
process (``recpipe.inprocess``) is invisible here, which is what lets ``recpipe bench chain`` put
the two side by side. Every hop gets the time left until the caller's deadline; every hop is timed
(``observed_us``, perf_counter_ns around the call) next to the time the stage reports for itself
(``server_us``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import numpy as np

from recpipe.config import (
    DEFAULT_NUM_CANDIDATES,
    DEFAULT_NUM_RESULTS,
    MAX_NUM_CANDIDATES,
    STEPS,
    TOTAL_STEP,
)
from recpipe.errors import BadRequest, DeadlineExceeded
from recpipe.types import Recommendation, StageResult, StageTiming

U = TypeVar("U")
I = TypeVar("I")  # noqa: E741 - U(ser) and I(tems), the two payloads
U_co = TypeVar("U_co", covariant=True)
I_co = TypeVar("I_co", covariant=True)
U_contra = TypeVar("U_contra", contravariant=True)
I_contra = TypeVar("I_contra", contravariant=True)


# The user's and the items' features are opaque to the chain: it hands what the feature client
# returned to the retrieval and ranking clients unchanged. In process they are ``UserFeatures`` and
# ``ItemFeatures``; over gRPC they are the stage's response messages, forwarded tensor by tensor without
# being decoded and re-encoded in the gateway (the next stage validates them when it decodes them).


class FeatureClient(Protocol[U_co, I_co]):
    async def augment_user(self, user_id: int, timeout: float | None) -> StageResult[U_co]: ...

    async def augment_items(self, user_id: int, item_ids: np.ndarray, timeout: float | None) -> StageResult[I_co]: ...


class RetrievalClient(Protocol[U_contra]):
    async def retrieve(self, user: U_contra, k: int, timeout: float | None) -> StageResult[np.ndarray]:
        """(k,) int64 item ids, best first; k 0 = the stage's default, which also owns the bound on k."""
        ...


class RankingClient(Protocol[U_contra, I_contra]):
    async def rank(self, user: U_contra, items: I_contra, timeout: float | None) -> StageResult[np.ndarray]:
        """(k,) float32 scores in the order of ``items``."""
        ...


class Chain(Generic[U, I]):
    """The gateway's logic over three stage clients."""

    def __init__(
        self, features: FeatureClient[U, I], retrieval: RetrievalClient[U], ranking: RankingClient[U, I]
    ) -> None:
        self.features = features
        self.retrieval = retrieval
        self.ranking = ranking
        self.model_version = ""
        #: per step (``STEPS``), the queries in ``recommend`` that have yet to reach it, and what to call
        #: when one of them reaches it or leaves early (a batched hop waits for them: ``Hop.upstream``)
        self.ahead = [0] * len(STEPS)
        #: the queries in ``recommend`` now (1: the one asking is alone, and its hops send at once: ``Hop.alone``)
        self.active = 0
        self.on_pass: list[Callable[[], None] | None] = [None] * len(STEPS)

    @staticmethod
    def resolve_sizes(num_candidates: int, num_results: int) -> tuple[int, int]:
        """Check the request's sizes and apply the result default (0 -> 10). ``num_candidates`` 0 stays
        0: the retrieval stage applies its default (500, or the whole catalogue when smaller) and owns
        the bound against the catalogue."""
        if num_candidates < 0:
            raise BadRequest(f"num_candidates must be >= 0, got {num_candidates}")
        if num_results < 0:
            raise BadRequest(f"num_results must be >= 0, got {num_results}")
        if num_candidates > MAX_NUM_CANDIDATES:
            raise BadRequest(f"num_candidates must be <= {MAX_NUM_CANDIDATES}, got {num_candidates}")
        k = num_candidates or DEFAULT_NUM_CANDIDATES
        n = num_results or min(DEFAULT_NUM_RESULTS, k)
        if n > k:
            raise BadRequest(f"num_results ({n}) must be <= num_candidates ({k})")
        return num_candidates, n

    async def recommend(
        self, user_id: int, num_candidates: int = 0, num_results: int = 0, deadline: float | None = None
    ) -> Recommendation:
        """One Recommend call. ``deadline`` is a ``time.monotonic()`` instant (None = no deadline)."""
        start = time.perf_counter_ns()
        k, n = self.resolve_sizes(num_candidates, num_results)
        for step in range(len(self.ahead)):
            self.ahead[step] += 1
        self.active += 1
        reached = [0]  # the steps this query has passed (reached, or left before)
        try:
            return await self._recommend(user_id, k, n, deadline, start, reached)
        finally:
            self.active -= 1
            self._reach(reached, len(self.ahead))

    def alone(self) -> bool:
        """Whether one query is in ``recommend`` (the one asking)."""
        return self.active == 1

    def between(self, before: int, step: int) -> int:
        """The queries in flight that have reached step ``before`` but not yet ``step``."""
        return self.ahead[step] - self.ahead[before]

    def _reach(self, reached: list[int], step: int) -> None:
        """A query reaches ``step`` (``len(STEPS)``: it is done, or failed before the steps it missed)."""
        for passed in range(reached[0], step):
            self.ahead[passed] -= 1
            notify = self.on_pass[passed]
            if notify is not None:
                notify()
        reached[0] = max(reached[0], step)

    async def _recommend(self, user_id: int, k: int, n: int, deadline: float | None, start: int,
                         reached: list[int]) -> Recommendation:
        timings: list[StageTiming] = []
        t0 = time.perf_counter_ns()
        self._reach(reached, 1)
        user = await self.features.augment_user(user_id, _remaining(deadline, STEPS[0]))
        t1 = time.perf_counter_ns()
        timings.append(user.timing(STEPS[0], (t1 - t0) // 1000))

        self._reach(reached, 2)
        found = await self.retrieval.retrieve(user.value, k, _remaining(deadline, STEPS[1]))
        t2 = time.perf_counter_ns()
        timings.append(found.timing(STEPS[1], (t2 - t1) // 1000))
        ids = found.value  # distinct, valid ids: the retrieval core never pads (``Candidates``)
        if ids.size == 0:
            raise RuntimeError(f"retrieval returned no candidates for user {user_id}")

        self._reach(reached, 3)
        items = await self.features.augment_items(user_id, ids, _remaining(deadline, STEPS[2]))
        t3 = time.perf_counter_ns()
        timings.append(items.timing(STEPS[2], (t3 - t2) // 1000))

        self._reach(reached, 4)
        ranked = await self.ranking.rank(user.value, items.value, _remaining(deadline, STEPS[3]))
        t4 = time.perf_counter_ns()
        timings.append(ranked.timing(STEPS[3], (t4 - t3) // 1000))

        top_ids, top_scores = top_n(ids, ranked.value, n)
        if ranked.model_version:
            self.model_version = ranked.model_version
        total = (time.perf_counter_ns() - start) // 1000
        timings.append(StageTiming(TOTAL_STEP, total, total))
        return Recommendation(top_ids, top_scores, tuple(timings), self.model_version)


def top_n(item_ids: np.ndarray, scores: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` highest-scoring items, scores descending."""
    if scores.shape != item_ids.shape:
        raise RuntimeError(f"rank returned {scores.shape[0]} scores for {item_ids.shape[0]} candidates")
    n = min(n, item_ids.shape[0])
    if n < item_ids.shape[0]:
        part = np.argpartition(-scores, n - 1)[:n]
        order = part[np.argsort(-scores[part], kind="stable")]
    else:
        order = np.argsort(-scores, kind="stable")
    return item_ids[order].astype(np.int64, copy=False), scores[order].astype(np.float32, copy=False)


def _remaining(deadline: float | None, stage: str) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(f"deadline passed before {stage}")
    return left
