"""What a stage hands the server: its servicers, its service names, an explicit load step and its info.

A stage's heavy state (tables, index, weights) is loaded in ``load()``, after the server is already
answering health checks with NOT_SERVING; the server reports SERVING only once ``load()`` returns.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from grpc import aio

from recpipe.errors import DeadlineExceeded, StageUnavailable
from recpipe.serving import threads as thread_settings
from recpipe.serving.batcher import BatchConfig, Batcher

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

    @abc.abstractmethod
    def add_to_server(self, server: aio.Server) -> None: ...

    @abc.abstractmethod
    async def load(self) -> None: ...

    @abc.abstractmethod
    def info(self) -> StageInfo: ...

    async def close(self) -> None:
        """Release what ``load`` acquired (channels, executors) after the server stopped."""
        return None

    def readiness(self) -> ReadinessWatch | None:
        """What decides the health status after ``load``: None (most stages) means SERVING from then
        on; the gateway returns a watch over the stages it calls (``recpipe.gateway.readiness``)."""
        return None


class CoreStage(Stage, Generic[C]):
    """A stage serving one pure core: ``load`` builds the core from ``loader`` off the event loop.

    Subclasses add the servicer methods and ``info``, and create their batchers in ``_start`` (once the
    core exists) with ``_batcher``; ``thread_pool`` names the library whose thread count the stage
    reports ("torch" or "polars"). ``workers`` 0 runs core calls inline on the event loop (the cheapest
    hop); N > 0 runs the batched calls on the batcher's thread and the others on a pool of N threads, so
    the loop keeps accepting and refusing requests while a core computes.
    """

    thread_pool: str = "torch"

    def __init__(
        self, loader: Callable[[], C], *, workers: int = 0, threads: int = 0, batch: BatchConfig | None = None
    ) -> None:
        self._loader = loader
        self._core: C | None = None
        self._run = CoreRunner(workers)
        self._threads = threads
        self.batch_config = batch or BatchConfig()
        self._batchers: list[Batcher[Any, Any]] = []

    async def load(self) -> None:
        core = await asyncio.to_thread(self._loader)
        self._start(core)
        self._core = core
        self._threads = thread_settings.in_use(self.thread_pool) or self._threads

    def _start(self, core: C) -> None:
        """Create the batchers over the loaded ``core`` (none by default)."""

    def _batcher(self, method: str, fn: Callable[[Sequence[Q]], Sequence[R | BaseException]],
                 device: str = "cpu") -> Batcher[Q, R]:
        """A batcher for ``method`` over ``fn``; ``device`` (the core's) resolves ``--max-batch 0``."""
        self.batch_config = self.batch_config.for_device(device)
        batcher: Batcher[Q, R] = Batcher(f"{self.name}.{method}", fn, self.batch_config,
                                         threaded=self._run.threaded)
        self._batchers.append(batcher)
        return batcher

    def batch_details(self) -> dict[str, str]:
        """The batching knobs, for InfoService."""
        c = self.batch_config
        return {"max_batch": str(c.max_batch), "max_queue_delay_us": str(c.max_queue_delay_us),
                "max_queue": str(c.max_queue)}

    async def close(self) -> None:
        for batcher in self._batchers:
            await batcher.close()
        self._run.close()

    def _ready(self) -> C:
        """The loaded core; UNAVAILABLE while it is still loading."""
        if self._core is None:
            raise StageUnavailable(f"{self.name}: still loading")
        return self._core


class CoreRunner:
    """Runs a core call either inline on the event loop or on a dedicated thread pool.

    Inline costs nothing extra but blocks the loop for the call; a thread hop costs tens of
    microseconds but lets the loop accept other requests while torch/FAISS/numpy (which release the
    GIL) compute. ``recpipe bench chain --executor`` measures both.
    """

    def __init__(self, workers: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="core") if workers > 0 else None

    @property
    def threaded(self) -> bool:
        return self._executor is not None

    async def __call__(self, fn: Callable[..., T], *args: object) -> T:
        if self._executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        if self._executor is not None:
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


def elapsed_us(start_ns: int) -> int:
    return (time.perf_counter_ns() - start_ns) // 1000
