"""The three ways of offering load: sequential, closed loop and open loop (asyncio, no gRPC here).

A ``Send`` is ``async send(i) -> (status, timings)`` for query ``i`` (status ``"OK"`` or a gRPC status
code name); ``recpipe.querygen.clients`` builds them. Every loop returns a ``Recorder``.
"""

from __future__ import annotations

import asyncio
import math
import selectors
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from recpipe.querygen.progress import Progress
from recpipe.querygen.recorder import Recorder, Timing

Outcome = tuple[str, Sequence[Timing]]
Send = Callable[[int], Awaitable[Outcome]]
T = TypeVar("T")

#: how long before the first query the schedule starts, so set-up work does not show up as send lag
_LEAD_S = 0.02


def new_event_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose timers fire within tens of microseconds of their due time.

    asyncio's default epoll selector rounds every timeout *up* to a whole millisecond, which would send
    each query up to 1 ms late (or force a busy wait). select(2) takes microsecond timeouts; its fd
    limit does not matter here, as the generator's loop watches only a handful of descriptors (gRPC
    does its own socket I/O).
    """
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on ``new_event_loop()``."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)


async def sleep_until(due: float) -> None:
    """Return at ``time.perf_counter() >= due`` (precisely on a ``new_event_loop()`` loop)."""
    while (remaining := due - time.perf_counter()) > 0:
        await asyncio.sleep(remaining)


async def _one(send: Send, i: int, scheduled: float, rec: Recorder) -> None:
    sent = time.perf_counter()
    status, timings = await send(i)
    done = time.perf_counter()
    if status == "OK":
        rec.ok(scheduled, sent, done, timings)
    else:
        rec.error(scheduled, sent, done, status)


async def run_open(
    send: Send, arrivals: Sequence[float], warmup: float, progress: Progress | None = None, *,
    indices: Sequence[int] | None = None, base: float | None = None,
) -> Recorder:
    """Send query ``indices[i]`` (default ``i``) at ``base + arrivals[i]`` seconds (plus ``warmup``
    already inside the schedule). ``base`` is a ``perf_counter`` instant (default: just after now);
    sender processes share one, so their shares of a schedule run on one clock (``perf_counter`` is the
    system's monotonic clock, the same in every process).

    Sending never waits for answers: each query is its own task, started at its scheduled instant; when
    the generator falls behind it sends the overdue queries at once, and their latency still counts from
    the scheduled instant.
    """
    base = time.perf_counter() + _LEAD_S if base is None else base
    rec = Recorder(measure_from=base + warmup)
    ticker = progress.start(rec, base) if progress else None
    pending: set[asyncio.Task[None]] = set()
    order = range(len(arrivals)) if indices is None else indices
    try:
        for i, t in zip(order, arrivals, strict=True):
            due = base + t
            await sleep_until(due)
            task = asyncio.create_task(_one(send, i, due, rec))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.gather(*pending)
    finally:
        for task in pending:
            task.cancel()
        if progress and ticker:
            await progress.stop(ticker)
    return rec


async def run_closed(
    send: Send,
    concurrency: int,
    warmup: float,
    duration: float | None = None,
    queries: int | None = None,
    progress: Progress | None = None,
    *,
    base: float | None = None,
    index_start: int = 0,
    index_step: int = 1,
) -> Recorder:
    """``concurrency`` clients, each sending its next query the moment its last one is answered.

    Stops after ``duration`` measured seconds or ``queries`` measured queries (whichever is given).
    Latency counts from the actual send: this is the loop that hides a stalled server (while it stalls,
    nobody sends, so only ``concurrency`` queries see the stall). ``base`` (a ``perf_counter`` instant,
    default now) starts the clock; queries are ``index_start``, ``index_start + index_step``, ... (sender
    process k of n takes k, k + n, ...: disjoint parts of one query stream).
    """
    if base is None:
        base = time.perf_counter()
    else:
        await sleep_until(base)
    rec = Recorder(measure_from=base + warmup)
    end = base + warmup + duration if duration is not None else math.inf
    next_index = 0
    issued = 0
    ticker = progress.start(rec, base) if progress else None

    async def client() -> None:
        nonlocal next_index, issued
        while True:
            now = time.perf_counter()
            if now >= end:
                return
            if now >= rec.measure_from:
                if queries is not None and issued >= queries:
                    return
                issued += 1
            i = index_start + next_index * index_step
            next_index += 1
            await _one(send, i, now, rec)

    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        if progress and ticker:
            await progress.stop(ticker)
    return rec
