"""One stage in this process: build it from its ``StageConfig``, serve until SIGINT/SIGTERM, drain.

This is what ``recpipe serve --stage NAME`` runs, and what the supervisor starts once per stage. When a
supervisor started the process (``RECPIPE_SUPERVISOR_PID`` set) it also stops by itself if that
supervisor disappears, so a killed supervisor leaves no orphan servers behind.

A *warm standby* (``cfg.standby``) does all the slow work first (imports, artifacts, the stage's
``load``) without taking the port, then waits for SIGUSR1: the supervisor sends it when the stage's
serving process dies or freezes, and the standby binds the port and reports SERVING in milliseconds,
instead of a new process spending seconds on imports and loading while the chain is down.

A replica (``cfg.bind_after_load``: ``recpipe serve --replicas``) also loads before it takes its port,
then serves at once: its callers reach every replica's address, and a connection that cannot be made
yet keeps a loading replica out of their choice, where a bound but loading one would be handed calls it
can only refuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from recpipe.serving import heap
from recpipe.serving.config import StageConfig
from recpipe.serving.server import StageServer
from recpipe.serving.stage import Stage

log = logging.getLogger(__name__)

SUPERVISOR_ENV = "RECPIPE_SUPERVISOR_PID"
#: The line a stage prints once it reports SERVING (the supervisor relies on health, not on this).
READY_PREFIX = "recpipe-stage-ready"
#: The signal that turns a warm standby into the serving process, and the environment variable naming
#: the pipe on which the standby tells its supervisor it has loaded (only then may it be signalled).
ACTIVATE = signal.SIGUSR1
STANDBY_FD_ENV = "RECPIPE_STANDBY_FD"


async def serve(cfg: StageConfig, stage: Stage) -> None:
    """Serve ``stage`` (built from ``cfg`` by ``recpipe.stages.build_stage``) until SIGINT/SIGTERM (or
    the supervisor's death), then drain and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loaded = cfg.standby or cfg.bind_after_load
    if loaded and not await _load_first(stage, stop, wait=cfg.standby):
        await stage.close()
        return
    server = await StageServer.start(stage, host=cfg.host, port=cfg.port, metrics_port=cfg.metrics_port,
                                     reuse_port=cfg.reuse_port, own_port=cfg.own_port)
    watchdog = asyncio.create_task(_watch_supervisor(stop))
    try:
        loading = asyncio.create_task(server.load(loaded=loaded))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            loading.result()  # a failed load (ArtifactMismatch, ...) propagates from here
            metrics = f" metrics=http://{cfg.host}:{server.metrics_port}/metrics" if server.metrics_port else ""
            print(f"{READY_PREFIX} {stage.name} {server.address}{metrics}", flush=True)
            await stopping
        else:
            loading.cancel()
    finally:
        watchdog.cancel()
        log.info("%s: draining (grace %.1fs)", stage.name, cfg.grace_s)
        await server.stop(cfg.grace_s)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _load_first(stage: Stage, stop: asyncio.Event, *, wait: bool) -> bool:
    """Load ``stage`` before taking the port and, with ``wait`` (a warm standby), wait for ``ACTIVATE``;
    False if told to stop (or orphaned) first."""
    activate = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(ACTIVATE, activate.set)
    watchdog = asyncio.create_task(_watch_supervisor(stop))
    try:
        await stage.load()
        heap.settle(stage.name)  # here, not at activation: a full collection of a loaded heap takes 0.2 s
        if not wait or stop.is_set():
            return not stop.is_set()
        log.info("%s: warm standby loaded, waiting", stage.name)
        fd = os.environ.get(STANDBY_FD_ENV)
        if fd:
            os.write(int(fd), b"1")
            os.close(int(fd))
        waits = {asyncio.create_task(activate.wait()), asyncio.create_task(stop.wait())}
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return activate.is_set() and not stop.is_set()
    finally:
        watchdog.cancel()
        loop.remove_signal_handler(ACTIVATE)


async def _watch_supervisor(stop: asyncio.Event) -> None:
    pid = os.environ.get(SUPERVISOR_ENV)
    if not pid:
        return
    with contextlib.suppress(asyncio.CancelledError):
        while not stop.is_set():
            if os.getppid() != int(pid):
                print(f"recpipe: supervisor {pid} is gone; stopping", file=sys.stderr, flush=True)
                stop.set()
                return
            await asyncio.sleep(1.0)
