"""What a stage hands the server: its servicers, its service names, an explicit load step and its info.

A stage's heavy state (tables, index, weights) is loaded in ``load()``, after the server is already
answering health checks with NOT_SERVING; the server reports SERVING only once ``load()`` returns.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from recpipe.config import MAX_BATCH_ENTRIES, MAX_BATCH_ROWS, MAX_STREAM_MESSAGES
from recpipe.errors import (
    BadRequest,
    DeadlineExceeded,
    MalformedRequest,
    RecpipeError,
    StageUnavailable,
    clip,
)
from recpipe.serving import codec, nvtx
from recpipe.serving import threads as thread_settings
from recpipe.serving.batcher import BatchConfig, Batched, Batcher
from recpipe.serving.channels import MAX_MESSAGE_BYTES
from recpipe.serving.inline import COMPUTE_CPU_KEY, CallCost, start_thread
from recpipe.serving.outcomes import Outcome
from recpipe.serving.status import code_for

if TYPE_CHECKING:
    from grpc import aio

    from recpipe.serving.config import StageConfig
    from recpipe.serving.metrics import ServerMetrics

_log = logging.getLogger(__name__)

T = TypeVar("T")
C = TypeVar("C")
Q = TypeVar("Q")
R = TypeVar("R")

#: ``watch(report)`` runs for as long as the server does and calls ``report(serving)`` on every change.
ReadinessWatch = Callable[[Callable[[bool], Awaitable[None]]], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class StageInfo:
    """What InfoService reports about a stage (see ``recpipe.v1.ServiceInfo``)."""

    stage: str
    device: str = "cpu"
    model_version: str = ""
    threads: int = 0
    details: dict[str, str] = field(default_factory=dict)


class Stage(abc.ABC):
    """One gRPC stage: ``add_to_server`` registers its servicers, ``load`` builds its state."""

    #: "gateway", "features", "retrieval" or "ranking".
    name: str
    #: Fully qualified names of the services it adds (health and reflection list them).
    service_names: tuple[str, ...]
    #: its server's metrics (``build_server`` sets them), where a batch entry's error is counted
    metrics: ServerMetrics | None = None
    #: the largest request message its server reads; a larger one is refused RESOURCE_EXHAUSTED by gRPC
    #: (the chain's limit, which a stage's batch and stream messages need; the gateway's requests are tiny)
    max_request_bytes: int = MAX_MESSAGE_BYTES

    @abc.abstractmethod
    def add_to_server(self, server: aio.Server) -> None: ...

    @abc.abstractmethod
    async def load(self) -> None: ...

    @abc.abstractmethod
    def info(self) -> StageInfo: ...

    async def close(self) -> None:
        """Release what ``load`` acquired (channels, executors) after the server stopped."""
        return None

    async def drain(self) -> None:
        """Before the server stops: end what would keep it open past its grace (a hop's stream, which
        lives as long as its caller wants) once what it carries is answered."""
        return None

    def readiness(self) -> ReadinessWatch | None:
        """What decides the health status after ``load``: None (most stages) means SERVING from then
        on; the gateway returns a watch over the stages it calls (``recpipe.gateway.readiness``)."""
        return None


@dataclass(frozen=True)
class Method(Generic[C, Q, R]):
    """One RPC of a ``CoreStage``, as its servicer declares it; ``CoreStage.handle`` runs the steps.

    ``decode(core, request)``: the wire request decoded and checked into the contract's typed query
    (``*Query.checked``), or ``BadRequest``. ``batch(core)``: the core's batch entry point (queries ->
    answers, one per query), run through the stage's dynamic batcher; or ``single(core)``: a call on one
    query, run directly (for calls too cheap to queue). ``encode(core, answer)``: the response message,
    whose ``server_us``/``queue_us``/``compute_us``/``batch_size`` the template fills in. ``step`` names
    the request's steps in NVTX ranges (``{step}.decode`` ...). ``rows(query)``: what a query's compute
    time grows with (candidates, items; None: 1 per query), from which the stage predicts whether a
    call is short enough to run inline on the event loop (``recpipe.serving.inline``).
    """

    name: str
    step: str
    decode: Callable[[C, Any], Q]
    encode: Callable[[C, R], Any]
    batch: Callable[[C], Callable[[Sequence[Q]], Sequence[R | BaseException]]] | None = None
    single: Callable[[C], Callable[[Q], R]] | None = None
    rows: Callable[[Q], int] | None = None

    def __post_init__(self) -> None:
        if (self.batch is None) == (self.single is None):
            raise TypeError(f"{self.name}: give exactly one of batch and single")


class CoreStage(Stage, Generic[C]):
    """A stage serving one pure core, with the request template every stage shares.

    ``load`` builds the core from ``loader`` off the event loop and starts a dynamic batcher for each
    batched ``Method``. ``handle(method, request, context)`` is the template: deadline, readiness,
    decode and check, submit to the batcher (or call the core), encode, timing. A servicer declares its
    ``methods``, ``describe(core)`` for InfoService, and one line per RPC calling ``handle``.
    ``thread_pools`` names the libraries whose thread count the stage reports, the first one loaded in
    the process ("torch", "faiss" or "polars").
    ``workers`` 0 runs core calls inline on the event loop (the cheapest hop) when they are predicted
    short, and the others on a thread, so that no long call holds the loop and its health service
    (``recpipe.serving.inline``); N > 0 runs every unbatched call on a pool of N threads and every
    batched one on its batcher's thread, so the loop keeps accepting and refusing requests while a core
    computes. So a core's entry points run on more than one thread, and an unbatched one's calls may
overlap; a batcher makes one call at a time.
    """

    thread_pools: tuple[str, ...] = ("torch",)
    methods: tuple[Method[C, Any, Any], ...] = ()

    def __init__(
        self, loader: Callable[[], C], *, workers: int = 0, threads: int = 0, batch: BatchConfig | None = None
    ) -> None:
        self._loader = loader
        self._core: C | None = None
        self._run = CoreRunner(workers)
        self._threads = threads
        self._batch_config = batch or BatchConfig()
        self._batchers: dict[str, Batcher[Any, Any]] = {}
        #: The seconds per row of each unbatched method (batched ones: their batcher's ``cost``).
        self._costs: dict[str, CallCost] = {}
        #: the open streams' handler tasks (``handle_stream``), and what tells them the server is stopping
        #: (``drain``)
        self._streams: set[asyncio.Task[Any]] = set()
        self._draining: asyncio.Event | None = None

    @classmethod
    def over(cls, loader: Callable[[], C], cfg: StageConfig) -> CoreStage[C]:
        """The stage over the core ``loader`` builds, with ``cfg``'s workers, threads and batching."""
        return cls(loader, workers=cfg.workers, threads=cfg.threads, batch=cfg.batch)

    async def load(self) -> None:
        core = await asyncio.to_thread(self._loader)
        device = getattr(core, "device", "cpu")
        for m in self.methods:
            if m.batch is not None:
                self._batchers[m.name] = Batcher(f"{self.name}.{m.name}", m.batch(core), self._batch_config,
                                                 device=device, inline=self._run.inline, rows=m.rows)
            else:
                self._costs[m.name] = CallCost()
        self._core = core
        self._threads = next((n for n in map(thread_settings.in_use, self.thread_pools) if n), self._threads)

    def describe(self, core: C) -> dict[str, str]:
        """What InfoService reports of the loaded core besides device, version and threads."""
        return {}

    def info(self) -> StageInfo:
        core = self._core
        if core is None:
            return StageInfo(self.name, threads=self._threads, details={"state": "loading"})
        return StageInfo(self.name, getattr(core, "device", "cpu"), getattr(core, "model_version", ""),
                         self._threads, {**self.describe(core), **self.batch_details(),
                                         COMPUTE_CPU_KEY: f"{self.compute_cpu_s():.6f}"})

    def compute_cpu_s(self) -> float:
        """The CPU seconds the core's calls spent so far, every entry point, batched or not
        (``CallCost.cpu_s``)."""
        costs = [b.cost for b in self._batchers.values()] + list(self._costs.values())
        return sum(c.cpu_s for c in costs)

    def batch_details(self) -> dict[str, str]:
        """The batching knobs in force ("auto" resolved once the core is loaded), for InfoService."""
        c = next(iter(self._batchers.values())).config if self._batchers else self._batch_config
        return {"max_batch": str(c.max_batch), "max_queue_delay_us": str(c.max_queue_delay_us),
                "max_queue": str(c.max_queue)}

    async def handle(self, method: Method[C, Q, R], request: Any, context: aio.ServicerContext) -> Any:
        """The request template (see the class docstring)."""
        start = time.perf_counter_ns()
        deadline = check_deadline(context, self.name)
        return await self._answer(method, self._ready(), request, deadline, start)

    async def handle_batch(self, method: Method[C, Q, R], request: Any, context: aio.ServicerContext,
                           entry: Callable[..., Any]) -> list[Any]:
        """A batch call: ``request.entries`` each run through the template as if it had come alone (its
        own deadline from ``request.timeout_us``, else the call's), all at once, so the batcher queues
        them together; -> one ``entry(ok=response)`` or ``entry(error=EntryError)`` per entry, in order.
        A bad entry fails itself only; a message over the batch limits (``check_batch``) fails whole,
        INVALID_ARGUMENT, before any entry's work."""
        start = time.perf_counter_ns()
        check_batch(len(request.entries), 0, self.name)
        return await self._batch(method, request, check_deadline(context, self.name), entry, start, "Batch")

    async def handle_stream(self, method: Method[C, Q, R], requests: AsyncIterator[Any], context: aio.ServicerContext,
                            entry: Callable[..., Any], response: Callable[..., Any]) -> None:
        """A stream call: each message of ``requests`` a batch call (``handle_batch``, its entries'
        deadlines their own ``timeout_us``: the stream has none), answered as soon as it is done by a
        ``response(entries=..., sequence=...)`` message with the request's ``sequence``; the messages
        are handled side by side, as separate batch calls would be, ``MAX_STREAM_MESSAGES`` at most: the
        next is read once one of them is written (a caller that does not read its answers is held back by
        flow control, not buffered for). An error of a whole message (the
        stage still loading) is each of its entries' error. Ends when the caller ends its side and
        every answer is written; a caller that goes away cancels what is left. A message with more
        entries than ``MAX_BATCH_ENTRIES``, or one that does not parse (``MalformedRequest``, from the
        interceptor's request iterator), ends the stream with INVALID_ARGUMENT once the messages before
        it are answered (answering each of its entries would be the very work the limit bounds); one over
        ``MAX_BATCH_ROWS`` is each entry's error."""
        write = asyncio.Lock()
        handling: set[asyncio.Task[None]] = set()

        async def answer(request: Any) -> None:
            start = time.perf_counter_ns()
            try:
                entries = await self._batch(method, request, None, entry, start, "Stream")
            except Exception as e:  # the stage still loading (or a fault): every entry's error
                failed = self._entry_error(method, e)
                self._count_errors(method, "Stream", [failed] * len(request.entries))
                entries = [entry(error=codec.entry_error(failed))] * len(request.entries)
            reply = response(entries=entries, sequence=request.sequence)
            async with write:
                try:
                    await context.write(reply)
                except Exception as e:
                    if type(e).__name__ != "ExecuteBatchError":
                        raise
                    # gRPC's core refused the write: the call had ended under it (its caller cancelled it or
                    # went away; the handler is cancelled with it, a moment later). Counted as the interceptor
                    # counts an answer it could not send (``_UnsentAnswers``), not an "exception was never
                    # retrieved" traceback per stream
                    self._count_unsent(method, "Stream")

        slots = asyncio.Semaphore(MAX_STREAM_MESSAGES)

        def done(task: asyncio.Task[None]) -> None:
            handling.discard(task)
            slots.release()

        async def read() -> None:
            async for request in requests:
                check_batch(len(request.entries), 0, self.name)  # else the stream ends, below
                await slots.acquire()  # the next message once one of those being answered is written
                task = asyncio.create_task(answer(request))
                handling.add(task)
                task.add_done_callback(done)

        if self._draining is None:
            self._draining = asyncio.Event()
        reading = asyncio.create_task(read())
        draining = asyncio.create_task(self._draining.wait())
        handler = asyncio.current_task()
        assert handler is not None
        self._streams.add(handler)
        try:
            # until the caller ends its side, or the server stops (``drain``): then what was read is
            # answered and the stream ends with OK, so the caller opens a new one
            await asyncio.wait((reading, draining), return_when=asyncio.FIRST_COMPLETED)
            refused: BadRequest | None = None
            if reading.done():
                try:
                    reading.result()  # the caller's side failed: so does the stream
                except BadRequest as e:  # a message over the limits, or malformed: what came before it is answered first
                    refused = e
            while handling:
                await asyncio.gather(*handling)
            if refused is not None:
                if self.metrics is not None and not isinstance(refused, MalformedRequest):  # the interceptor counted it
                    self.metrics.error(self._rpc_name(method, "Stream"), code_for(refused).name)
                await context.abort(code_for(refused), clip(str(refused), codec.MAX_ENTRY_DETAILS))
        finally:
            self._streams.discard(handler)
            for task in (reading, draining, *handling):
                task.cancel()

    async def drain(self) -> None:
        """End every open stream once the messages it has read are answered (its caller opens a new
        one, which a stopping server refuses): a stream never ends on its own, so the server's stop
        would otherwise wait out its whole grace for it."""
        if self._draining is None:
            return
        self._draining.set()
        if self._streams:
            await asyncio.wait(set(self._streams))

    async def _batch(self, method: Method[C, Q, R], request: Any, deadline: float | None,
                     entry: Callable[..., Any], start: int, rpc: str) -> list[Any]:
        """``handle_batch``'s work, with the call's ``deadline`` (None: none) given; its entries' errors
        are counted under ``<method><rpc>``. Every entry is decoded first, so that a message over
        ``MAX_BATCH_ROWS``, or with more ``timeout_us`` than entries, is refused before any compute (a batch
        call whole; on a stream, as each entry's error); an entry whose deadline passes while its batch
        computes is answered DEADLINE_EXCEEDED, as ``timeout_us`` promises, not with an answer its
        caller has stopped waiting for."""
        core = self._ready()
        now = time.monotonic()
        answers: list[Any] = [None] * len(request.entries)
        if len(request.timeout_us) > len(answers):  # whose deadlines are they? a caller's misalignment: not guessed at
            raise BadRequest(f"{self.name}: {len(request.timeout_us)} timeout_us for {len(answers)} entries (at most "
                             "one per entry; fewer: the rest have the call's deadline)")
        timeouts = list(request.timeout_us)
        deadlines: list[float | None] = []
        for i in range(len(answers)):
            left = timeouts[i] if i < len(timeouts) else 0
            if left < 0:
                answers[i] = BadRequest(f"timeout_us must be >= 0 (0: the call's deadline), got {left}")
            deadlines.append(now + left / 1e6 if left > 0 else deadline)
        queued: list[tuple[int, Q]] = []
        for i, (r, d) in enumerate(zip(request.entries, deadlines, strict=True)):
            if answers[i] is None:
                try:
                    queued.append((i, self._decoded(method, core, r, d)))
                except Exception as e:
                    answers[i] = e
        check_batch(len(answers), sum(method.rows(q) for _, q in queued) if method.rows is not None else len(queued),
                    self.name)
        batcher = self._batchers.get(method.name)
        done: Sequence[Batched[R] | BaseException]
        if batcher is None:  # unbatched: each entry as it would run alone
            done = await asyncio.gather(*(self._computed(method, core, q, deadlines[i]) for i, q in queued),
                                        return_exceptions=True)
        else:  # one group for the batcher: the entries' core work in one call
            done = await batcher.submit_many([q for _, q in queued], [deadlines[i] for i, _ in queued])
        now = time.monotonic()
        for (i, _), result in zip(queued, done, strict=True):
            d = deadlines[i]
            if isinstance(result, BaseException):
                answers[i] = result
            elif d is not None and d <= now:
                answers[i] = DeadlineExceeded(f"{self.name}: the entry's deadline passed while its batch computed")
            else:
                try:
                    answers[i] = self._encoded(method, core, result, start)
                except Exception as e:  # an answer the contract refuses (non-finite scores, ...): its entry only
                    answers[i] = e
        failed = [self._entry_error(method, a) if isinstance(a, BaseException) else None for a in answers]
        self._count_errors(method, rpc, [e for e in failed if e is not None])
        return [entry(ok=a) if e is None else entry(error=codec.entry_error(e)) for a, e in zip(answers, failed, strict=True)]

    def _rpc_name(self, method: Method[C, Any, Any], rpc: str) -> str:
        """The metrics' name of ``method``'s ``rpc`` ("Batch", "Stream"), e.g. ``RankingService/RankStream``."""
        return f"{self.service_names[0].removeprefix('recpipe.v1.')}/{method.name}{rpc}"

    def _count_errors(self, method: Method[C, Any, Any], rpc: str, errors: Sequence[BaseException]) -> None:
        """Count the failed entries of a batch or stream message in the server's metrics, under the
        status each is answered with, as the interceptor counts a whole call's (``ServerMetrics.entry_failed``)."""
        if self.metrics is None or not errors:
            return
        name = self._rpc_name(method, rpc)
        for error in errors:
            self.metrics.entry_failed(name, code_for(error).name, clip(str(error), codec.MAX_ENTRY_DETAILS))

    def _count_unsent(self, method: Method[C, Any, Any], rpc: str) -> None:
        """An answer of ``method``'s ``rpc`` that could not be sent, its call over: counted and logged as
        counts, as a call its caller cancelled (``ServingInterceptor.unsent``)."""
        if self.metrics is None:
            return
        name = self._rpc_name(method, rpc)
        self.metrics.error(name, Outcome.CANCELLED.code)
        self.metrics.outcomes.record(Outcome.CANCELLED, name, "its answer could not be sent: the call had ended")

    def _entry_error(self, method: Method[C, Any, Any], error: BaseException) -> BaseException:
        """``error`` as an entry reports it: a domain error as it is; anything else is logged with its
        traceback and reported as INTERNAL (as the interceptor does for a whole call)."""
        if isinstance(error, RecpipeError):
            return error
        if isinstance(error, asyncio.CancelledError):
            raise error
        _log.error("%s: a batch entry failed", method.name, exc_info=error)
        return RuntimeError(f"{method.name}: internal error ({type(error).__name__}: {error})")

    async def _answer(self, method: Method[C, Q, R], core: C, request: Any, deadline: float | None,
                      start: int) -> Any:
        """One request's steps after the deadline check: decode and check, compute, encode, timing."""
        query = self._decoded(method, core, request, deadline)
        return self._encoded(method, core, await self._computed(method, core, query, deadline), start)

    async def _computed(self, method: Method[C, Q, R], core: C, query: Q, deadline: float | None) -> Batched[R]:
        """``query``'s answer: through the method's batcher, or a direct core call."""
        batcher = self._batchers.get(method.name)
        if batcher is not None:
            return await batcher.submit(query, deadline)
        assert method.single is not None
        computed = time.perf_counter_ns()
        with nvtx.range(f"{method.step}.compute"):
            rows = method.rows(query) if method.rows is not None else 1
            value = await self._run(method.single(core), query, self._costs[method.name], rows)
        return Batched(value, 0, elapsed_us(computed), 1)

    def _decoded(self, method: Method[C, Q, R], core: C, request: Any, deadline: float | None) -> Q:
        """The request decoded and checked into its query, unless its deadline has passed already."""
        if deadline is not None and deadline <= time.monotonic():
            raise DeadlineExceeded(f"{self.name}: deadline passed before the stage started")
        with nvtx.range(f"{method.step}.decode"):
            return method.decode(core, request)

    def _encoded(self, method: Method[C, Q, R], core: C, done: Batched[R], start: int) -> Any:
        """The response message of ``done``, with its timing."""
        with nvtx.range(f"{method.step}.encode"):
            response = method.encode(core, done.value)
        response.queue_us = done.queue_us
        response.compute_us = done.compute_us
        response.batch_size = done.batch_size
        response.server_us = elapsed_us(start)
        return response

    async def close(self) -> None:
        for batcher in self._batchers.values():
            await batcher.close()
        self._run.close()

    def _ready(self) -> C:
        """The loaded core; UNAVAILABLE while it is still loading."""
        if self._core is None:
            raise StageUnavailable(f"{self.name}: still loading")
        return self._core


class CoreRunner:
    """Runs an unbatched core call inline on the event loop or on a thread pool.

    Inline costs nothing extra but blocks the loop for the call; a thread hop costs tens to hundreds of
    microseconds but lets the loop accept other requests, and answer health checks, while torch/FAISS/
    numpy (which release the GIL) compute. ``workers`` N > 0: every call on a pool of N threads; 0: a
    call inline when its ``CallCost`` predicts it short, else on a thread of its own.
    ``recpipe bench hop --workers 0|1`` measures the hop.
    """

    def __init__(self, workers: int) -> None:
        self.inline = workers == 0
        # Threads start now, not with the first calls that need them (as the batcher's do).
        self._executor = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="core")
        start_thread(self._executor)

    async def __call__(self, fn: Callable[[Q], T], query: Q, cost: CallCost, rows: int = 1) -> T:
        if self.inline and cost.short(rows):
            return cost.call(fn, query, rows)
        return await asyncio.get_running_loop().run_in_executor(self._executor, cost.call, fn, query, rows)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def check_deadline(context: aio.ServicerContext, stage: str) -> float | None:
    """Refuse work whose caller's deadline has already passed; else the deadline as a
    ``time.monotonic()`` instant (None when the caller set none)."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    if remaining <= 0:
        raise DeadlineExceeded(f"{stage}: deadline passed before the stage started")
    return time.monotonic() + remaining


def check_batch(entries: int, rows: int, stage: str) -> None:
    """Refuse a batch or stream message over the limits every stage and the gateway agree on
    (``recpipe.config.MAX_BATCH_ENTRIES`` entries, ``MAX_BATCH_ROWS`` rows) with ``BadRequest``."""
    if entries > MAX_BATCH_ENTRIES:
        raise BadRequest(f"{stage}: {entries} entries in one batch message, at most {MAX_BATCH_ENTRIES}")
    if rows > MAX_BATCH_ROWS:
        raise BadRequest(f"{stage}: {rows} rows in one batch message (candidates or item ids summed over its "
                         f"entries), at most {MAX_BATCH_ROWS}")


def elapsed_us(start_ns: int) -> int:
    return (time.perf_counter_ns() - start_ns) // 1000
