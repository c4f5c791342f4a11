"""Building and running one stage's gRPC server: health, reflection, InfoService, metrics, interceptor.

``build_server`` follows grpc's examples: it returns ``(server, port)`` with the port actually bound, so
tests bind port 0. ``StageServer`` adds the life cycle: start (health NOT_SERVING) -> ``load()`` (heavy
state; health SERVING) -> ``stop(grace)`` (health NOT_SERVING, refuse new RPCs, drain in-flight ones).
``recpipe serve`` runs one ``StageServer`` per process (``recpipe.serving.runner``); ``ServerThread``
runs any number inside the current process, on an event loop in a background thread, for tests,
benchmarks and notebooks that want real gRPC servers (real sockets, real serialisation) without
separate processes (the whole chain on one: ``recpipe.inprocess.start_chain``)::

    with ServerThread() as st:
        features = st.start(feature_stage)          # -> StageServer, loaded and SERVING

Two kinds of health: ``""`` and the stage's service names are readiness (loaded; for the gateway, the
whole chain ready); ``LIVENESS_SERVICE`` is SERVING from start until stop, whatever the stages behind
say, so a liveness probe never restarts a gateway for a stage's outage (deploy/k8s probes it).

Every server closes each client connection after ``ConnectionAge.max_age_s`` (gRPC's
``max_connection_age``, with a grace for RPCs in flight): the client reconnects and re-resolves its
``dns:///`` name, so a long-lived channel finds replicas added after it started (gRPC proposal A9).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from recpipe.config import DEFAULT_HOST
from recpipe.errors import UsageError
from recpipe.serving import heap, info
from recpipe.serving.channels import MAX_MESSAGE_BYTES
from recpipe.serving.connection_age import ConnectionAge
from recpipe.serving.interceptor import ServingInterceptor
from recpipe.serving.metrics import ServerMetrics
from recpipe.serving.stage import Stage
from recpipe.v1 import info_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

SERVER_OPTIONS: tuple[tuple[str, object], ...] = (
    # gRPC sets SO_REUSEPORT by default, which would let a second server silently share a busy port.
    # Replicas of the entry stage share theirs on purpose (``reuse_port``), and only they.
    ("grpc.so_reuseport", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Calls that arrive while the event loop is busy wait in gRPC's core for a handler; past its own
    # limits (1,000 soft, 3,000 hard) it ends some CANCELLED, which the stage never sees: of 2,000 at once,
    # 84-232 ended so instead of meeting the stage's admission, which sheds them RESOURCE_EXHAUSTED in
    # microseconds. A waiting call costs a few hundred bytes.
    ("grpc.server.max_pending_requests", 100_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
)

#: The health service name a liveness probe asks: SERVING while this process serves, NOT_SERVING once
#: it stops; never follows readiness.
LIVENESS_SERVICE = "recpipe.Liveness"

def build_server(
    stage: Stage,
    *,
    host: str,
    port: int,
    health: HealthServicer,
    metrics: ServerMetrics,
    connection_age: ConnectionAge | None = None,
    reuse_port: bool = False,
    own_port: int | None = None,
    interceptor: ServingInterceptor | None = None,
) -> tuple[aio.Server, int]:
    """An unstarted server with ``stage``'s services, InfoService, health and reflection on host:port.

    Returns the server and the bound port (``port=0`` picks a free one). Raises ``UsageError`` when the
    address cannot be bound. ``connection_age`` None: ``ConnectionAge.from_env()``. ``reuse_port``: share
    the port with other processes that ask the same (SO_REUSEPORT), for a stage's replicas behind one
    address; ``own_port``: listen there too (0: a free port), where this process alone answers.
    """
    age = ConnectionAge.from_env() if connection_age is None else connection_age
    options = [*SERVER_OPTIONS, *age.options()]
    if reuse_port:
        options = [("grpc.so_reuseport", 1) if key == "grpc.so_reuseport" else (key, value) for key, value in options]
    # a request over the stage's own bound is refused RESOURCE_EXHAUSTED by gRPC before it is read whole
    options = [("grpc.max_receive_message_length", stage.max_request_bytes)
               if key == "grpc.max_receive_message_length" else (key, value) for key, value in options]
    server = aio.server(interceptors=[interceptor or ServingInterceptor(metrics)], options=options)
    stage.add_to_server(server)
    stage.metrics = metrics  # a batch or stream entry's error is counted under its method's (``CoreStage``)
    info_pb2_grpc.add_InfoServiceServicer_to_server(info.InfoServicer(stage.info), server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (*stage.service_names, info.SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = _listen(server, stage.name, host, port)
    if own_port is not None:
        _listen(server, stage.name, host, own_port)
    return server, bound


def _listen(server: aio.Server, name: str, host: str, port: int) -> int:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise UsageError(f"{name}: cannot listen on {address} (in use?): {e}") from e
    if bound == 0:
        raise UsageError(f"{name}: cannot listen on {address} (in use?)")
    return int(bound)


class StageServer:
    """A started server for one stage; see the module docstring for its life cycle."""

    def __init__(
        self,
        stage: Stage,
        server: aio.Server,
        host: str,
        port: int,
        health: HealthServicer,
        metrics: ServerMetrics,
        metrics_port: int | None,
        interceptor: ServingInterceptor | None = None,
    ) -> None:
        self.stage = stage
        #: refuses new calls once ``stop`` begins (None: a server built without one)
        self.interceptor = interceptor
        self.server = server
        self.host = host
        self.port = port
        self.health = health
        self.metrics = metrics
        self.metrics_port = metrics_port
        self._stopped = False
        self._readiness: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    async def start(
        cls, stage: Stage, *, host: str = DEFAULT_HOST, port: int = 0, metrics_port: int | None = None,
        connection_age: ConnectionAge | None = None, reuse_port: bool = False, own_port: int | None = None,
    ) -> StageServer:
        """Start answering (health NOT_SERVING until ``load``, liveness SERVING); ``metrics_port`` None =
        no /metrics; ``connection_age`` None = ``ConnectionAge.from_env()``; ``reuse_port`` and
        ``own_port``: see ``build_server``."""
        health = HealthServicer()
        for name in ("", *stage.service_names):
            await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        metrics = ServerMetrics(stage.name)
        interceptor = ServingInterceptor(metrics)
        server, bound = build_server(stage, host=host, port=port, health=health, metrics=metrics,
                                     connection_age=connection_age, reuse_port=reuse_port, own_port=own_port,
                                     interceptor=interceptor)
        await server.start()
        mport = None
        if metrics_port is not None:
            try:
                mport = metrics.serve_http(host, metrics_port)
            except OSError as e:
                await server.stop(None)
                raise UsageError(f"{stage.name}: cannot serve metrics on {host}:{metrics_port}: {e}") from e
        return cls(stage, server, host, bound, health, metrics, mport, interceptor)

    async def load(self, *, loaded: bool = False) -> None:
        """Load the stage's state (unless ``loaded``: a warm standby loaded it before it took the port),
        then report SERVING (or, for a stage with a readiness watch such as the gateway, whatever the
        watch reports from then on)."""
        if not loaded:
            await self.stage.load()
            heap.settle(self.stage.name)  # a stage loaded before it took the port settled then (runner)
        watch = self.stage.readiness()
        if watch is None:
            await self._report(True)
        else:
            self._readiness = asyncio.create_task(watch(self._report))
        log.info("%s loaded, answering on %s", self.stage.name, self.address)

    async def _report(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.stage.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING (readiness and liveness, before anything else, so probes and balancers stop
        sending), refuse new RPCs, let in-flight ones finish within ``grace`` seconds.

        New calls are refused UNAVAILABLE by the interceptor while the ones in flight finish, and only
        then does gRPC's server stop: it cancels the calls that had reached it but that no handler had
        taken up (grpc/grpc#10418), and a CANCELLED tells a client it cancelled the call itself (the
        gateway stopped under 8 clients: 1-3 of their calls CANCELLED in 2 of 5 stops)."""
        if self._stopped:
            return
        self._stopped = True
        if self._readiness is not None:
            self._readiness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._readiness
        await self.health.enter_graceful_shutdown()
        until = None if grace is None else time.monotonic() + grace
        if self.interceptor is not None:
            await self.interceptor.refuse_new(until)
        with contextlib.suppress(TimeoutError):  # a hop's streams end once answered, not after the grace
            await asyncio.wait_for(self.stage.drain(), None if until is None else max(until - time.monotonic(), 0))
        await self.server.stop(None if until is None else max(until - time.monotonic(), 0))
        await self.stage.close()
        self.metrics.close()


async def _collect_garbage() -> None:
    """Collect unreachable objects on this loop, then let their callbacks run. A grpc.aio call or channel
    collected after its loop has closed has gRPC's poller schedule its last events on that closed loop:
    "Event loop is closed", logged as an error by whichever loop runs the poller then."""
    gc.collect()
    await asyncio.sleep(0)


class ServerThread:
    """An asyncio loop in a daemon thread hosting any number of ``StageServer``s."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="recpipe-servers", daemon=True)
        self._thread.start()
        self.servers: list[StageServer] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the server loop and wait for its result (``RuntimeError`` once the loop has
        stopped: a coroutine handed to a stopped loop would never run, and its caller would wait forever)."""
        if self.loop.is_closed() or not self.loop.is_running():
            coro.close()
            raise RuntimeError("the server loop has stopped")
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
        self.run(_collect_garbage())  # gRPC objects of this loop finalized while it runs, not on a later one
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
