"""Batched hops: the gateway's calls of one stage method, gathered from the queries in flight and sent as
one batch call.

Every RPC costs the gateway and the stage about the same CPU whether its message carries one query or
many (on an H200 box 1.3-2.6 ms per query per process, nearly all gRPC and asyncio machinery), so the
gateway, which holds every query in flight, is the natural batcher. A ``Hop`` is the client-side twin
of the stages' dynamic batcher (``recpipe.serving.batcher``), with the same knobs:

- ``call(request, timeout)`` queues a call; a worker takes up to ``max_batch`` queued calls at a time,
  and no more rows than a stage takes in one message (``recpipe.config.MAX_BATCH_ROWS``: candidates or
  item ids summed over the calls, as the hop's ``rows`` counts them), waiting at most
  ``max_queue_delay_us`` after the first for others (0, the default, takes what is queued, so a lone
  query never waits), and sends them as one batch call, each entry with its own time left
  (``timeout_us``); a batch of one goes as the plain unary call;
- a query alone in the gateway (``alone``, set by the gateway: ``Chain.alone``) that finds the hop idle
  sends its call from its own task, past the queue, the worker's turn and a send task: at light load,
  where every query is alone, that machinery was a tenth of the gateway's CPU per query (2-core VM,
  sequential: 0.89x with it skipped); with company in the gateway, or a queue delay set, calls queue;
- at most ``max_in_flight`` batch calls are out at once (default: one per replica): while they are
  out, the calls that arrive queue, so under load batches grow by themselves and at low load a query
  goes alone at once;
- with ``upstream_wait_us`` a batch of an idle hop (none of its calls out) also waits, that long at
  most, for the queries the gateway knows are on their way to it (``upstream``: those at the hop
  before), so under load queries travel the chain together; a lone query has none behind it and never
  waits, and while one replica works another free one takes what comes at once;
- with several replicas (``Route``, one channel each) a batch goes to the first replica, in a fixed
  order, that has no call out and whose channel is up: one batch per replica at a time, as an
  inference server gives one batch to each model instance, and at low load every query meets the same
  warm process instead of visiting each replica in turn (a round-robin channel also sends a second
  batch to a busy replica while another is idle); while no replica's own channel is up (they are
  still connecting, or all down) the calls take the ``fallback`` route, the balanced channel over
  all of them;
- the hops of one stage's methods share what each replica has out (``busy``): a replica works one
  call at a time on its event loop (a short one inline, ``recpipe.serving.inline``), so a batch of
  cheap AugmentUser calls sent to the features replica that is computing a batch of AugmentItems waits
  for it; it goes to the first replica with nothing out of any method, else to the least busy;
- each call gets its own answer or its own error; a call whose deadline passes while queued is
  answered DEADLINE_EXCEEDED without being sent, and a cancelled one is dropped;
- a batch call (or a call alone) that finds its replica gone (UNAVAILABLE for the whole call: killed,
  stopping, its stream ended) goes once more to another replica that is up, with the time its calls
  have left: the stages' calls only read, so a second try answers what a dead replica left unanswered
  (kill -9 of one of 2 ranking replicas at 100 q/s failed 1-3 queries in flight); with no other
  replica up the error stands;
- how a batch travels is the route's business: with ``HopConfig.stream`` (``--hop-transport stream``,
  the gateway's default) the stage clients make each route send its batches, a batch of one too, as
  the messages of one long-lived stream (``recpipe.gateway.streams``), about half the CPU of an RPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from recpipe.config import MAX_BATCH_ROWS
from recpipe.errors import DeadlineExceeded, RecpipeError, StageUnavailable
from recpipe.serving.batcher import gather, wait_while

Req = TypeVar("Req")
Res = TypeVar("Res")

#: ``Hop._free_route``'s answer for the fallback route
_FALLBACK = -1
#: ``send_batch(requests, timeouts_us, timeout)`` -> one answer or domain error per request
BatchSend = Callable[[list[Any], list[int], float | None], Awaitable[Sequence[Any]]]


@dataclass(frozen=True)
class Route:
    """One way to a stage method: ``unary(request, timeout)``, ``batch(requests, timeouts_us, timeout)``
    and ``up()``: whether its channel can take a call now (not failing to connect)."""

    unary: Callable[[Any, float | None], Awaitable[Any]]
    batch: BatchSend
    up: Callable[[], bool] = lambda: True


@dataclass(frozen=True)
class HopConfig:
    """``max_batch`` calls per batch call at most (1: every call sent alone, at once, as before batched
    hops); ``max_queue_delay_us`` how long the first queued call may wait for others; ``max_in_flight``
    batch calls out at once (0: one per replica; spread evenly over the replicas)."""

    max_batch: int = 32
    max_queue_delay_us: int = 0
    max_in_flight: int = 0
    #: how long a batch may wait for the queries on their way to this hop (``Hop.upstream``)
    upstream_wait_us: int = 0
    #: send the calls as the messages of one stream per stage method and replica instead of as RPCs
    #: (``recpipe.gateway.streams``; the stage clients build the routes)
    stream: bool = False


@dataclass(eq=False, repr=False)
class _Call:
    """A queued call. Compared by identity and shown without its request: ``deque.remove`` of a call
    already taken into a batch compared it with every queued one and then put its repr in the
    ValueError, a Rank request of 10,000 candidates printed whole: 0.15-0.2 s of the gateway's loop per
    cancelled call, enough for its supervisor to take it for frozen."""

    request: Any
    deadline: float | None  # time.monotonic() instant
    future: asyncio.Future[Any]


class Hop(Generic[Req, Res]):
    """One stage method's calls from the gateway (see the module doc), over ``routes`` (one per replica)
    and ``fallback``; a route's ``unary`` and ``batch`` raise or return domain errors, never gRPC ones."""

    def __init__(self, name: str, routes: Sequence[Route], config: HopConfig, fallback: Route | None = None,
                 busy: list[int] | None = None, rows: Callable[[Req], int] | None = None) -> None:
        """``rows(request)``: what a call adds to a batch message's rows (``MAX_BATCH_ROWS``; None: 1)."""
        if not routes:
            raise ValueError(f"{name}: a hop needs at least one route")
        if busy is not None and len(busy) != len(routes):
            raise ValueError(f"{name}: {len(busy)} replica counts for {len(routes)} routes")
        self.name = name
        self.routes = list(routes)
        self.fallback = fallback
        self.config = config
        self._rows: Callable[[Req], int] = rows or (lambda request: 1)
        self.max_in_flight = config.max_in_flight or len(self.routes)
        #: batch calls out at once on one route
        self.per_route = math.ceil(self.max_in_flight / len(self.routes))
        self._out = [0] * len(self.routes)
        #: the batch calls out on each route from every hop of the stage (this one's only, unshared)
        self._busy = busy if busy is not None else [0] * len(self.routes)
        self._turn = -1
        self._queue: deque[_Call] = deque()
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._in_flight = 0
        self._sends: set[asyncio.Task[None]] = set()
        #: batch calls sent and the calls they carried (for ``GetInfo`` and the tests), and the batch
        #: calls each route took
        self.batches = 0
        self.calls = 0
        self.sent_per_route = [0] * len(self.routes)
        #: the queries in flight that will reach this hop next (set by the gateway: those at the step
        #: before, ``Chain.between``); with ``upstream_wait_us`` a batch waits for them, and ``nudge``
        #: is called when one arrives or leaves
        self.upstream: Callable[[], int] | None = None
        self._waiting_upstream = False
        #: whether the query making a call is the only one in the gateway (set by the gateway:
        #: ``Chain.alone``); such a call, finding the hop idle, is sent from its own task (``_alone``)
        self.alone: Callable[[], bool] | None = None
        #: the calls sent that way (for ``GetInfo`` and the tests)
        self.sent_alone = 0
        #: batch calls (and calls alone) sent a second time, to another replica, after their first found
        #: its replica gone
        self.resent_elsewhere = 0

    async def __call__(self, request: Req, timeout: float | None) -> Res:
        if self.config.max_batch <= 1:  # unbatched: each call at once, the replicas taken in turn
            self._turn += 1
            n = len(self.routes)
            turn = next((i % n for i in range(self._turn, self._turn + n) if self.routes[i % n].up()), None)
            if turn is None:
                turn = _FALLBACK if self.fallback is not None else self._turn % n
            return await self._one(request, timeout, turn, claim=False)
        if (self.alone is not None and not self._queue and not self._in_flight and not self.config.max_queue_delay_us
                and self.alone()):
            route = self._free_route()
            if route is not None:
                return await self._alone(request, timeout, route)
        loop = asyncio.get_running_loop()
        if self._worker is None:
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._run(), name=f"hop-{self.name}")
        call = _Call(request, None if timeout is None else time.monotonic() + timeout, loop.create_future())
        self._queue.append(call)
        assert self._wake is not None
        self._wake.set()
        try:
            return await call.future  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                self._queue.remove(call)
            call.future.cancel()
            raise

    async def close(self) -> None:
        for call in self._queue:
            if not call.future.done():
                call.future.set_exception(StageUnavailable(f"{self.name}: the gateway is stopping"))
        self._queue.clear()
        for task in [*self._sends, *([self._worker] if self._worker is not None else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        assert self._wake is not None
        cfg = self.config
        while True:
            while not self._queue or self._free_route() is None:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(0)  # let the calls that are already on their way join this batch
            if cfg.max_queue_delay_us and len(self._queue) < cfg.max_batch:
                await gather(self._queue, self._wake, cfg.max_batch, cfg.max_queue_delay_us / 1e6)
            if cfg.upstream_wait_us and self.upstream is not None and not self._in_flight:
                await self._wait_upstream(self.upstream, cfg)
            route = self._free_route()  # None if the route found free went down meanwhile: wait again
            if route is None:
                continue
            batch = self._take(cfg.max_batch)
            if batch:
                self._claim(route)
                task = asyncio.get_running_loop().create_task(self._send(batch, route))
                self._sends.add(task)
                task.add_done_callback(self._sends.discard)

    def nudge(self) -> None:
        """A query in flight reached this hop or left the chain before it (``Chain.on_pass``)."""
        if self._waiting_upstream and self._wake is not None:
            self._wake.set()

    async def _wait_upstream(self, upstream: Callable[[], int], cfg: HopConfig) -> None:
        """Hold the batch while queries in flight are on their way to this hop (``upstream``: those at
        the hop before, so the wait is about one hop's time), so they join it: up to
        ``upstream_wait_us``, and never past half the time left of a queued call. A lone query has none
        behind it and never waits; under load the queries move through the chain together, one batch
        call per hop instead of one per query or two."""
        assert self._wake is not None
        now = time.monotonic()
        until = now + cfg.upstream_wait_us / 1e6
        for call in self._queue:
            if call.deadline is not None:
                until = min(until, now + (call.deadline - now) / 2)
        self._waiting_upstream = True
        try:
            await wait_while(lambda: len(self._queue) < cfg.max_batch and upstream() > 0, self._wake, until)
        finally:
            self._waiting_upstream = False

    def _route(self, index: int) -> Route:
        if index == _FALLBACK:
            assert self.fallback is not None
            return self.fallback
        return self.routes[index]

    def _free_route(self) -> int | None:
        """Of the routes with room for a batch call and a channel that is up, the first (in their fixed
        order) with nothing out of any hop of the stage, else the one with the fewest calls out; where
        no route is up, the fallback (``_FALLBACK``), else the first with room (its call fails at once,
        as the stage is down); None while the calls out fill ``max_in_flight`` or every route that is
        up is busy."""
        if self._in_flight >= self.max_in_flight:
            return None
        first_with_room = best = None
        any_up = False
        for i, route in enumerate(self.routes):
            up = route.up()
            any_up = any_up or up
            if self._out[i] < self.per_route:
                if up:
                    if not self._busy[i]:
                        return i
                    if best is None or self._busy[i] < self._busy[best]:
                        best = i
                elif first_with_room is None:
                    first_with_room = i
        if best is not None:
            return best
        if any_up:
            return None
        return _FALLBACK if self.fallback is not None else first_with_room

    def _take(self, n: int) -> list[_Call]:
        """Up to ``n`` live calls from the head of the queue, of ``MAX_BATCH_ROWS`` rows at most together
        (the first one whatever its rows: a call alone is within the contract's); expired ones are
        answered and dropped."""
        batch: list[_Call] = []
        now = time.monotonic()
        rows = 0
        while self._queue and len(batch) < n:
            call = self._queue[0]
            if call.future.done():
                self._queue.popleft()
                continue
            if call.deadline is not None and call.deadline <= now:
                self._queue.popleft()
                call.future.set_exception(DeadlineExceeded(f"deadline exceeded before {self.name} (queued in the gateway)"))
                continue
            rows += self._rows(call.request)
            if batch and rows > MAX_BATCH_ROWS:
                break  # the next batch's first call
            batch.append(self._queue.popleft())
        return batch

    async def _send(self, batch: list[_Call], index: int) -> None:
        answers: Sequence[Any] = []
        for attempt in (0, 1):
            route = self._route(index)
            now = time.monotonic()
            lefts = [None if c.deadline is None else max(c.deadline - now, 1e-6) for c in batch]
            timeout = None if any(t is None for t in lefts) else max(t for t in lefts if t is not None)
            elsewhere = None
            try:
                if len(batch) == 1:
                    answers = [await route.unary(batch[0].request, lefts[0])]
                else:
                    answers = await route.batch([c.request for c in batch],
                                                [timeout_us(t) for t in lefts], timeout)
                    if len(answers) != len(batch):
                        raise StageUnavailable(f"{self.name}: a batch of {len(batch)} got {len(answers)} answers")
            except StageUnavailable as e:  # the replica is gone: once more on another, if one is up
                answers = [e] * len(batch)
                elsewhere = None if attempt else self._elsewhere(index, batch)
            except RecpipeError as e:  # the whole call failed (the deadline passed, ...)
                answers = [e] * len(batch)
            finally:
                self._release(index, len(batch))
            if elsewhere is None:
                break
            index = elsewhere
            self._claim(index)
            self.resent_elsewhere += 1
        for call, answer in zip(batch, answers, strict=True):
            if call.future.done():
                continue
            if isinstance(answer, BaseException):
                call.future.set_exception(answer)
            else:
                call.future.set_result(answer)

    async def _alone(self, request: Req, timeout: float | None, index: int) -> Res:
        """A lone query's call, the hop idle: sent from the caller's own task as a batch of one, without
        the queue, the worker's turn and a send task (see the module doc)."""
        self.sent_alone += 1
        return await self._one(request, timeout, index, claim=True)

    async def _one(self, request: Req, timeout: float | None, index: int, claim: bool) -> Res:
        """One call on route ``index`` (``claim``: counted as a batch call out), once more on another
        route that is up if the first finds its replica gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        retried = False
        while True:
            at = index
            if claim:
                self._claim(at)
            try:
                return await self._route(at).unary(request, timeout)  # type: ignore[no-any-return]
            except StageUnavailable:
                elsewhere = None if retried else self._elsewhere(at)
                left = None if deadline is None else deadline - time.monotonic()
                if elsewhere is None or (left is not None and left <= 0):
                    raise
                index, timeout, retried = elsewhere, left, True
                self.resent_elsewhere += 1
            finally:
                if claim:
                    self._release(at, 1)

    def _elsewhere(self, index: int, batch: Sequence[_Call] = ()) -> int | None:
        """Where a call that found route ``index``'s replica gone goes once more: another route that is
        up, the least busy (None: none is, or every call of ``batch`` has run out of time)."""
        if len(self.routes) == 1 or (batch and not any(c.deadline is None or c.deadline > time.monotonic()
                                                        for c in batch)):
            return None
        best = None
        for i, route in enumerate(self.routes):
            if i != index and route.up() and (best is None or self._busy[i] < self._busy[best]):
                best = i
        return best

    def _claim(self, index: int) -> None:
        """A batch call goes out on route ``index``."""
        self._in_flight += 1
        if index != _FALLBACK:
            self._out[index] += 1
            self._busy[index] += 1

    def _release(self, index: int, calls: int) -> None:
        """A batch call of ``calls`` calls on route ``index`` is back (answered or failed); the worker may
        send the next."""
        self._in_flight -= 1
        if index != _FALLBACK:
            self._out[index] -= 1
            self._busy[index] -= 1
            self.sent_per_route[index] += 1
        if self._wake is not None:
            self._wake.set()
        self.batches += 1
        self.calls += calls


def timeout_us(left: float | None) -> int:
    """A batch entry's ``timeout_us`` for ``left`` seconds (None: no deadline, 0 on the wire; at least
    1 µs otherwise, so a deadline about to pass is not taken for none)."""
    return 0 if left is None else max(1, int(left * 1e6))


def replica_targets(target: str) -> list[str]:
    """The target of each server a gRPC target names: each address of an ``ipv4:``/``ipv6:`` list
    (``recpipe serve --replicas``), else the target itself (a host:port, or a DNS name whose replicas
    are not known until it resolves and which its channel balances)."""
    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6") and rest:
        listed = [a.strip() for a in rest.split(",") if a.strip()]
        if len(listed) > 1:
            return [f"{scheme}:{a}" for a in listed]
    return [target]
