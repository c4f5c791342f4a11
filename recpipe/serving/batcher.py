"""The dynamic batcher every batched stage shares: gather concurrent requests into one core call.

Modelled on Triton's dynamic batcher and queue policy and Ray Serve's ``@serve.batch`` /
``max_queued_requests``:

- ``submit(query, deadline)`` puts a request in a bounded queue and waits for its answer;
- one worker task takes up to ``max_batch`` queued requests at a time, waiting at most
  ``max_queue_delay_us`` after the first for others to arrive (0: take what is already queued), runs
  the core's batch function once and hands each request its own answer. The call runs on the batcher's
  own thread, or inline on the event loop where inline calls are allowed and the call is predicted
  short from the batcher's seconds per row (``recpipe.serving.inline``): a long call never holds the
  loop, so the health service keeps answering while it computes;
- **admission**: a request is refused at once with ``Overloaded`` (RESOURCE_EXHAUSTED) when the queue
  is full, or when its remaining deadline is shorter than the stage's recent service time per request
  times the requests queued and running ahead of it plus its own (it could not finish in time, so
  doing its work would only delay the others). With nobody ahead the shortfall is the deadline's,
  not the load's, and the answer is DEADLINE_EXCEEDED;
- a queued request whose deadline passes, or whose caller cancels, is dropped before any work is done
  on it and frees its slot at once;
- every answer carries its queue time, the compute time of the core call and the batch size, the
  split perf_analyzer reports.

While a batch computes on the thread, the loop keeps accepting requests, so under load batches grow by
themselves (adaptive batching) and at low load a request runs alone, with no added delay unless
``max_queue_delay_us`` asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from recpipe.errors import DeadlineExceeded, Overloaded, RecpipeError, StageUnavailable, UsageError
from recpipe.serving import nvtx
from recpipe.serving.inline import CallCost, start_thread
from recpipe.serving.options import StageOptions, option
from recpipe.serving.waits import wait_event

Q = TypeVar("Q")
R = TypeVar("R")

#: Weight of the newest batch in the service-time average the admission check uses.
_EWMA = 0.2


#: ``--max-batch 0`` (auto): batches of this many requests at most where the core runs on a GPU.
GPU_MAX_BATCH = 32


@dataclass(frozen=True)
class BatchConfig(StageOptions):
    """The batcher's knobs (``recpipe serve --max-batch/--max-queue-delay-us/--max-queue``).

    ``max_batch`` requests at most per core call; ``max_queue_delay_us`` how long the first queued
    request may wait for others (0 = take what is queued); ``max_queue`` requests waiting at most,
    beyond which new ones are refused. ``max_batch=1`` turns batching off (one core call per request,
    still queued and admitted the same way); 0 (the default) is ``GPU_MAX_BATCH`` for a core on a GPU
    and 1 on a CPU. On a CPU a forward over B requests costs about B forwards, so a batch only makes
    its first requests wait for the last (measured in BENCHMARKS.md); on a GPU it costs about one.
    """

    group = "dynamic batching and admission (retrieval, ranking, AugmentItems)"

    max_batch: int = option(0, help="requests per core call at most (1 = batching off; default 0 = auto: 32 where "
                                    "the stage computes on a GPU, 1 on a CPU, where a batch only adds waiting)")
    max_queue_delay_us: int = option(0, help="how long the first queued request may wait for others, in µs "
                                             "(0 = take what is queued; default 0)")
    max_queue: int = option(256, help="requests waiting per stage method at most; more are refused with "
                                      "RESOURCE_EXHAUSTED (default 256)")

    def __post_init__(self) -> None:
        if self.max_batch < 0:
            raise UsageError(f"--max-batch must be >= 0 (0 = auto), got {self.max_batch}")
        if self.max_queue_delay_us < 0:
            raise UsageError(f"--max-queue-delay-us must be >= 0, got {self.max_queue_delay_us}")
        if self.max_queue < 1:
            raise UsageError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.max_queue < self.max_batch:
            raise UsageError(f"--max-queue ({self.max_queue}) must be >= --max-batch ({self.max_batch})")

    def for_device(self, device: str) -> BatchConfig:
        """The knobs with ``max_batch`` 0 resolved for a core on ``device`` ("cpu", "cuda:0 (...)")."""
        if self.max_batch:
            return self
        size = GPU_MAX_BATCH if device.startswith("cuda") else 1
        return BatchConfig(size, self.max_queue_delay_us, max(self.max_queue, size))


@dataclass(frozen=True)
class Batched(Generic[R]):
    """One request's answer from a batch: queue_us waited before its core call started, compute_us of
    that call, batch_size requests in it."""

    value: R
    queue_us: int
    compute_us: int
    batch_size: int


@dataclass(eq=False, repr=False)
class _Pending(Generic[Q, R]):
    """A queued request, compared by identity and shown without its query (``recpipe.gateway.hops._Call``
    says why: ``deque.remove`` compares, and prints what it did not find)."""

    query: Q
    future: asyncio.Future[Batched[R]]
    deadline: float | None  # time.monotonic() instant
    enqueued_ns: int
    rows: int
    #: the batch call it came in (0: alone): a group is taken into one core call whole
    group: int = 0
    nvtx_queue: int | None = None


def _one_row(query: object) -> int:
    return 1


class Batcher(Generic[Q, R]):
    """Batches ``fn(queries) -> answers`` (one answer, or an exception instance, per query) for ``stage``.

    ``fn`` runs on a thread of its own, so the event loop stays free to accept, refuse and queue requests
    and to answer health checks meanwhile. With ``inline``, a call predicted short (``cost``: its seconds
    per row, ``rows(query)`` rows per query, 1 by default) runs on the loop instead, which saves the
    thread hop (tens to hundreds of microseconds per batch) but leaves arriving requests, refusals
    included, waiting for the batch. Such a call that finds the batcher idle with batching off (a lone
    request, or a batch call's entries, which form one core call of their own anyway) runs in the
    caller's own task, past the worker's hand-off (``_alone``).
    """

    def __init__(self, stage: str, fn: Callable[[Sequence[Q]], Sequence[R | BaseException]],
                 config: BatchConfig, *, device: str = "cpu", inline: bool = False,
                 rows: Callable[[Q], int] | None = None) -> None:
        self.stage = stage
        self.fn = fn
        #: The knobs with "auto" resolved for ``device``, once: ``max_batch`` is >= 1 from here on (the
        #: caller's ``config`` is left as it was).
        self.config = config.for_device(device)
        assert self.config.max_batch >= 1
        self._nvtx_queue, self._nvtx_compute = (f"{nvtx.step_prefix(stage)}.{step}" for step in ("queue", "compute"))
        self._queue: deque[_Pending[Q, R]] = deque()
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self.inline = inline
        self._rows = rows or _one_row
        #: Seconds per row of ``fn``, which decides where a call runs (``recpipe.serving.inline``).
        self.cost = CallCost()
        # Its thread starts now, not with the first call that needs it (a thread start on the request
        # path made a fresh stage's first calls 1-3 ms slower).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{stage}-core")
        start_thread(self._executor)
        self._closed = False
        self._running: list[_Pending[Q, R]] = []
        #: Recent core time per request in seconds (EWMA of batch time / batch size); 0 until the first
        #: batch ran. Per request rather than per batch: a batch's time grows with its size, and once the
        #: load is gone the next request runs alone, so a per-batch figure learnt under load would keep
        #: refusing requests the idle stage could serve.
        self.request_s = 0.0
        self.batches = 0
        self._group = 0

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, query: Q, deadline: float | None = None) -> Batched[R]:
        """Queue ``query`` and wait for its answer; ``deadline`` is a ``time.monotonic()`` instant."""
        self._admit(deadline)
        rows = self._rows(query)
        if self._alone(rows):
            answer = self._call_now([query], rows)[0]
            if isinstance(answer, BaseException):
                raise answer
            return answer
        pending = self._enqueue(query, deadline, rows)
        self._wake_worker()
        try:
            return await pending.future
        except asyncio.CancelledError:
            self._drop([pending])
            raise

    async def submit_many(self, queries: Sequence[Q], deadlines: Sequence[float | None]) -> list[Batched[R] | Exception]:
        """Queue ``queries`` as one group (a batch call's entries) and wait for every answer: each its
        answer or its own error (admission per query, as ``submit``). The worker never splits a group
        across core calls, whatever ``max_batch``: its entries come back in one response anyway, so one
        core call makes none of them wait longer, and saves a core call per entry. Each entry is admitted
        behind the group's entries admitted before it, as if they had come alone one after another: they
        count against ``max_queue`` and in the time it expects."""
        self._group += 1
        out: list[Batched[R] | Exception | None] = []  # every slot filled below: its refusal or its answer
        admitted: list[tuple[int, Q, float | None, int]] = []
        for query, deadline in zip(queries, deadlines, strict=True):
            try:
                self._admit(deadline, len(admitted))
            except RecpipeError as e:
                out.append(e)
                continue
            admitted.append((len(out), query, deadline, self._rows(query)))
            out.append(None)
        rows = sum(a[3] for a in admitted)
        if admitted and self._alone(rows):  # the group would be a core call of its own anyway: now
            for (i, *_), done in zip(admitted, self._call_now([a[1] for a in admitted], rows), strict=True):
                out[i] = done
            return cast("list[Batched[R] | Exception]", out)
        pending = [(i, self._enqueue(query, deadline, n, self._group)) for i, query, deadline, n in admitted]
        if pending:
            self._wake_worker()
            try:
                answers = await asyncio.gather(*(p.future for _, p in pending), return_exceptions=True)
            except asyncio.CancelledError:
                self._drop([p for _, p in pending])
                raise
            for (i, _), answer in zip(pending, answers, strict=True):
                if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                    raise answer  # cancelled
                out[i] = answer
        return cast("list[Batched[R] | Exception]", out)

    def _admit(self, deadline: float | None, group: int = 0) -> None:
        """Refuse a request at once (see the module doc: closed, queue full, deadline not coverable);
        ``group``: the requests of its own batch call admitted before it, not queued yet."""
        if self._closed:
            raise StageUnavailable(f"{self.stage}: shutting down")
        if len(self._queue) + group >= self.config.max_queue:
            raise Overloaded(f"{self.stage}: queue full ({self.config.max_queue} requests waiting)")
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"{self.stage}: deadline passed before the request was queued")
            ahead = len(self._queue) + len(self._running) + group
            expected = (ahead + 1) * self.request_s
            if left < expected and not ahead:
                # an idle stage could not make it either: the deadline is too short, not the stage too busy
                raise DeadlineExceeded(f"{self.stage}: {left * 1e3:.2f} ms left of the deadline, less than the "
                                       f"stage's recent service time {expected * 1e3:.2f} ms")
            if left < expected:
                raise Overloaded(f"{self.stage}: {left * 1e3:.1f} ms left of the deadline, less than the "
                                 f"{expected * 1e3:.1f} ms the {len(self._queue) + group} queued and "
                                 f"{len(self._running)} running requests need at the recent service time")

    def _enqueue(self, query: Q, deadline: float | None, rows: int, group: int = 0) -> _Pending[Q, R]:
        loop = asyncio.get_running_loop()
        if self._worker is None:
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._run(), name=f"{self.stage}-batcher")
        pending: _Pending[Q, R] = _Pending(query, loop.create_future(), deadline, time.perf_counter_ns(), rows, group)
        self._queue.append(pending)
        pending.nvtx_queue = nvtx.start(self._nvtx_queue)
        return pending

    def _wake_worker(self) -> None:
        assert self._wake is not None
        self._wake.set()

    def _drop(self, pending: Sequence[_Pending[Q, R]]) -> None:
        """The caller went away: free the slots now rather than when the worker reaches them."""
        for p in pending:
            with contextlib.suppress(ValueError):
                self._queue.remove(p)
                nvtx.end(p.nvtx_queue)
            p.future.cancel()

    async def close(self) -> None:
        """Fail what is still queued or computing with UNAVAILABLE and stop the worker."""
        self._closed = True
        for p in [*self._queue, *self._running]:
            if not p.future.done():
                p.future.set_exception(StageUnavailable(f"{self.stage}: shutting down"))
        self._queue.clear()
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        cfg = self.config
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            # Let handlers whose requests already arrived enqueue them before the batch is cut.
            await asyncio.sleep(0)
            if cfg.max_queue_delay_us and len(self._queue) < cfg.max_batch:
                await self._gather(cfg.max_queue_delay_us / 1e6)
            batch = self._take(cfg.max_batch)
            if not batch:
                continue
            start = time.perf_counter_ns()
            self._running = batch
            compute_range = nvtx.start(self._nvtx_compute)
            queries = [p.query for p in batch]
            rows = sum(p.rows for p in batch)
            answers: Sequence[R | BaseException]
            if self.inline and self.cost.short(rows):
                answers = self._answers(queries, rows)
            else:
                try:
                    answers = await loop.run_in_executor(self._executor, self._answers, queries, rows)
                except Exception as e:  # the thread did not take the call (shutting down)
                    answers = [e] * len(batch)
            end = time.perf_counter_ns()
            self._running = []
            nvtx.end(compute_range)
            compute_us = self._learn(start, end, len(batch))
            for p, answer in zip(batch, answers, strict=True):
                if p.future.done():  # cancelled while computing
                    continue
                if isinstance(answer, BaseException):
                    p.future.set_exception(answer)
                else:
                    p.future.set_result(Batched(answer, (start - p.enqueued_ns) // 1000, compute_us, len(batch)))

    def _alone(self, rows: int) -> bool:
        """Whether a call of ``rows`` (one request, or a batch call's group) may run at once on the loop:
        with batching off, inline core calls, nothing queued or running and a short call predicted,
        there is nothing to batch it with and nothing ahead of it (a group is never split nor joined
        with another when batching is off), so the worker's hand-off (three extra event-loop turns per
        call) would only add latency and CPU."""
        return (self.inline and self.config.max_batch == 1 and not self._queue and not self._running
                and self.cost.short(rows))

    def _call_now(self, queries: list[Q], rows: int) -> list[Batched[R] | Exception]:
        """``queries`` run at once on the loop as one core call (``_alone``): each its answer or its own
        error; a failure of the whole call is every query's."""
        start = time.perf_counter_ns()
        compute_range = nvtx.start(self._nvtx_compute)
        answers = self._answers(queries, rows)
        end = time.perf_counter_ns()
        nvtx.end(compute_range)
        compute_us = self._learn(start, end, len(queries))
        out: list[Batched[R] | Exception] = []
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(a, Exception):
                raise a
            out.append(a if isinstance(a, Exception) else Batched(cast("R", a), 0, compute_us, len(queries)))
        return out

    def _answers(self, queries: list[Q], rows: int) -> Sequence[R | BaseException]:
        """One core call of ``queries`` (``rows`` rows) through ``cost``, on whatever thread runs it: each
        query's answer or its own error; a failure of the whole call, or a wrong count of answers, is
        every query's error."""
        try:
            answers = self.cost.call(self.fn, queries, rows)
            if len(answers) != len(queries):
                raise RuntimeError(f"{self.stage}: batch of {len(queries)} got {len(answers)} answers")
            return answers
        except Exception as e:
            return [e] * len(queries)

    def _learn(self, start_ns: int, end_ns: int, size: int) -> int:
        """Fold a core call of ``size`` requests into the service-time estimate; its compute µs."""
        per_request = (end_ns - start_ns) / 1e9 / size
        self.request_s = per_request if self.batches == 0 else (1 - _EWMA) * self.request_s + _EWMA * per_request
        self.batches += 1
        return (end_ns - start_ns) // 1000

    async def _gather(self, delay_s: float) -> None:
        assert self._wake is not None
        await gather(self._queue, self._wake, self.config.max_batch, delay_s)

    def _take(self, n: int) -> list[_Pending[Q, R]]:
        """Up to ``n`` live requests from the head of the queue, and the rest of the group of the last one
        taken (a batch call's entries stay together); expired ones are answered and dropped."""
        batch: list[_Pending[Q, R]] = []
        now = time.monotonic()
        group = 0
        while self._queue and (len(batch) < n or (group and self._queue[0].group == group)):
            p = self._queue.popleft()
            group = p.group
            nvtx.end(p.nvtx_queue)  # dropped or taken: its wait in the queue ends here
            p.nvtx_queue = None
            if p.future.done():
                continue
            if p.deadline is not None and p.deadline <= now:
                p.future.set_exception(DeadlineExceeded(f"{self.stage}: deadline passed while queued"))
                continue
            batch.append(p)
        return batch


async def gather(queue: Sized, wake: asyncio.Event, size: int, delay_s: float) -> None:
    """Wait up to ``delay_s`` for ``queue`` to hold ``size`` items, woken by ``wake`` whenever one is
    added: the queue delay of a batcher (this one, and the gateway's batched hops)."""
    await wait_while(lambda: len(queue) < size, wake, time.monotonic() + delay_s)


async def wait_while(waiting: Callable[[], bool], wake: asyncio.Event, until: float) -> None:
    """Wait while ``waiting()`` holds, until the ``time.monotonic()`` instant ``until`` at most, checking
    again whenever ``wake`` is set."""
    while waiting():
        left = until - time.monotonic()
        if left <= 0:
            return
        wake.clear()
        await wait_event(wake, left)
