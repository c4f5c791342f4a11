"""One stage in this process: build it from its ``StageConfig``, serve until SIGINT/SIGTERM, drain.

This is what ``recpipe serve --stage NAME`` runs, and what the supervisor starts once per stage. When a
supervisor started the process (``RECPIPE_SUPERVISOR_PID`` set) it also stops by itself if that
supervisor disappears, so a killed supervisor leaves no orphan servers behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from recpipe.serving.config import StageConfig
from recpipe.serving.server import StageServer
from recpipe.serving.stage import Stage

log = logging.getLogger(__name__)

SUPERVISOR_ENV = "RECPIPE_SUPERVISOR_PID"
#: The line a stage prints once it reports SERVING (the supervisor relies on health, not on this).
READY_PREFIX = "recpipe-stage-ready"


async def serve(cfg: StageConfig, stage: Stage) -> None:
    """Serve ``stage`` (built from ``cfg`` by ``recpipe.stages.build_stage``) until SIGINT/SIGTERM (or
    the supervisor's death), then drain and stop."""
    server = await StageServer.start(stage, host=cfg.host, port=cfg.port, metrics_port=cfg.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watchdog = asyncio.create_task(_watch_supervisor(stop))
    try:
        loading = asyncio.create_task(server.load())
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
