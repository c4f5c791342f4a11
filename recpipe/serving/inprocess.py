"""Run stage servers inside the current process, on an event loop in a background thread.

For tests, benchmarks and notebooks that want real gRPC servers (real sockets, real serialisation)
without separate processes; ``recpipe serve`` runs one stage per process instead. The whole chain on
one of these is ``recpipe.inprocess.start_chain``.

    with ServerThread() as st:
        features = st.start(feature_stage)          # -> StageServer, loaded and SERVING
        gateway = st.start(GatewayStage(features.address, ...))
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from recpipe.config import DEFAULT_HOST
from recpipe.serving.server import StageServer
from recpipe.serving.stage import Stage

T = TypeVar("T")


class ServerThread:
    """An asyncio loop in a daemon thread hosting any number of ``StageServer``s."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="recpipe-servers", daemon=True)
        self._thread.start()
        self.servers: list[StageServer] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the server loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(
        self, stage: Stage, *, host: str = DEFAULT_HOST, port: int = 0, metrics_port: int | None = None,
        load: bool = True,
    ) -> StageServer:
        """Start ``stage`` on host:port (0 = free port) and, unless ``load`` is false, load it."""

        async def go() -> StageServer:
            server = await StageServer.start(stage, host=host, port=port, metrics_port=metrics_port)
            if load:
                try:
                    await server.load()
                except BaseException:
                    await server.stop(None)
                    raise
            return server

        server = self.run(go())
        self.servers.append(server)
        return server

    def stop(self, server: StageServer, grace: float | None = 1.0) -> None:
        self.run(server.stop(grace))
        if server in self.servers:
            self.servers.remove(server)

    def close(self, grace: float | None = 1.0) -> None:
        """Stop every server and the loop."""
        if not self.loop.is_running():
            return
        for server in list(reversed(self.servers)):
            self.stop(server, grace)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
