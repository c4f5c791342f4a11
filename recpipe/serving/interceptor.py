"""The one server interceptor: domain errors -> gRPC status codes, plus per-RPC metrics.

Every handler is wrapped once per method (the wrapper is cached, so a request pays one dict lookup, not
a handler rebuild). A ``RecpipeError`` escaping a unary handler becomes its status code from
``recpipe.serving.status``; anything else becomes INTERNAL with a log line carrying the traceback, and
the process keeps serving. Status messages are cut to ``MAX_DETAILS`` characters whatever they quote.

The expected outcomes are counted under their code and logged as counts at most once per interval
(``recpipe.serving.outcomes``), never as tracebacks: a refusal (RESOURCE_EXHAUSTED), a deadline the call
could not make (DEADLINE_EXCEEDED), a call its caller cancelled, and a call whose deadline passed before
its answer or status was sent. Nothing is sent for the last: its caller has already timed out, and gRPC
can no longer send on the call (it would log an ``ExecuteBatchError`` traceback for trying), so the
handler ends as a cancelled one. Where the caller goes away after the check, gRPC's core still logs that
traceback; a filter on its logger counts it as a cancelled call instead (``_UnsentAnswers``).

Every method, streaming ones included (health Watch, reflection), is registered with a tolerant
request deserializer (``recpipe.serving.malformed``): bytes that are not the method's message are
answered INVALID_ARGUMENT "malformed request", counted under that code, and logged as counts the same
way (on a stream, once the handler has written what it was writing: ``_refuse_malformed_stream``). Streaming handlers are otherwise passed through untouched, but for counting each message received as
one request (the gateway's hops send one batch call per message of a stream).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from grpc import aio

from recpipe.errors import MalformedRequest, RecpipeError, StageUnavailable, clip
from recpipe.serving import malformed
from recpipe.serving.metrics import ServerMetrics
from recpipe.serving.outcomes import Outcome
from recpipe.serving.status import code_for

log = logging.getLogger(__name__)

#: A handler as grpc.aio calls it (grpc-stubs types them as synchronous, hence the loose type).
Behavior = Callable[..., Any]
#: A status message longer than this is cut (the codec already cuts each quoted client value to 200).
MAX_DETAILS = 1000
#: how long a stopping server refuses new calls with no call being handled before gRPC's stop
SETTLE_S = 0.02
#: The status codes whose answers are expected outcomes, logged as counts.
_EXPECTED: dict[grpc.StatusCode, Outcome] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: Outcome.REFUSED,
    grpc.StatusCode.DEADLINE_EXCEEDED: Outcome.DEADLINE,
    grpc.StatusCode.CANCELLED: Outcome.CANCELLED,
}


class ServingInterceptor(aio.ServerInterceptor):
    """Maps errors to status codes and records requests, errors, latency and in-flight per method."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}
        _UNSENT.interceptors.add(self)
        #: the server is stopping: a new call of a recpipe service is refused UNAVAILABLE (``refuse_new``)
        self.stopping = False
        #: the unary calls being handled now
        self.active = 0

    async def refuse_new(self, until: float | None) -> None:
        """From now on refuse new calls of the recpipe services UNAVAILABLE, and return once the calls
        being handled are done and none has come for ``SETTLE_S`` (the ones that reached gRPC but no
        handler yet meet the refusal rather than being cancelled by the server's stop), or at ``until``
        (a ``time.monotonic()`` instant; None: no limit)."""
        self.stopping = True
        quiet_since = time.monotonic()
        while until is None or time.monotonic() < until:
            await asyncio.sleep(SETTLE_S / 4)
            if self.active:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= SETTLE_S:
                return

    def serves(self, method: str) -> bool:
        """Whether ``method`` ("/recpipe.v1.RankingService/Rank") is one of this server's."""
        return method in self._wrapped

    def unsent(self, method: str) -> None:
        """An answer of ``method`` that gRPC could not send, its call already over: counted and logged
        as counts, as a call its caller cancelled."""
        name = method.lstrip("/").removeprefix("recpipe.v1.")
        self._metrics.error(name, Outcome.CANCELLED.code)
        self._metrics.outcomes.record(Outcome.CANCELLED, name, "its answer could not be sent: the call had ended")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        wrapped = self._wrap_handler(method.lstrip("/").removeprefix("recpipe.v1."), handler)
        self._wrapped[method] = wrapped
        return wrapped

    def _wrap_handler(self, name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        deserialize = malformed.tolerant(handler.request_deserializer)
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            behavior = handler.unary_unary
            if inspect.iscoroutinefunction(behavior):
                behavior = self._wrap(name, behavior)
            return grpc.unary_unary_rpc_method_handler(
                self._refuse_malformed(name, behavior), request_deserializer=deserialize, response_serializer=serialize
            )
        if not _is_async(handler.unary_stream or handler.stream_unary or handler.stream_stream):
            return handler  # a synchronous streaming handler (none in recpipe's servers): left as it is
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._refuse_malformed(name, handler.unary_stream),
                request_deserializer=deserialize, response_serializer=serialize,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._refuse_malformed_stream(name, handler.stream_unary),
                request_deserializer=deserialize, response_serializer=serialize,
            )
        assert handler.stream_stream is not None  # the only kind left
        return grpc.stream_stream_rpc_method_handler(
            self._refuse_malformed_stream(name, handler.stream_stream),
            request_deserializer=deserialize, response_serializer=serialize,
        )

    def _count_malformed(self, name: str, request: malformed.Malformed) -> None:
        self._metrics.method(name).requests.inc()
        self._metrics.error(name, Outcome.MALFORMED.code)
        self._metrics.outcomes.record(Outcome.MALFORMED, name, request.describe())

    async def _answer_malformed(self, name: str, request: malformed.Malformed, context: aio.ServicerContext) -> None:
        self._count_malformed(name, request)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed.MESSAGE)

    def _refuse_malformed(self, name: str, behavior: Behavior) -> Behavior:
        """A unary-request handler that answers a ``Malformed`` request itself."""
        answer = self._answer_malformed
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, malformed.Malformed):
                    await answer(name, request, context)
                async for reply in behavior(request, context):
                    yield reply

            return stream
        if not inspect.iscoroutinefunction(behavior):
            # A synchronous handler (the health service's List, which grpcio-health-checking leaves
            # unimplemented): run on the default executor, as grpc.aio itself does for a server
            # without a migration thread pool.
            sync = behavior

            async def unary_sync(request: Any, context: aio.ServicerContext) -> Any:
                if isinstance(request, malformed.Malformed):
                    await answer(name, request, context)
                return await asyncio.get_running_loop().run_in_executor(None, sync, request, context)

            return unary_sync

        async def unary(request: Any, context: aio.ServicerContext) -> Any:
            if isinstance(request, malformed.Malformed):
                await answer(name, request, context)
            return await behavior(request, context)

        return unary

    def _refuse_malformed_stream(self, name: str, behavior: Behavior) -> Behavior:
        """A streaming-request handler whose request iterator stops at the first ``Malformed`` message and
        counts each message as one request (a hop's stream carries one batch call per message).

        A handler that answers by yielding (reflection's) writes in the task that reads, so its iterator
        aborts the call there. One that writes with ``context.write`` may read beside its writes (a stage's
        stream answers each message in a task of its own), and a status sent while a write is in flight is
        refused by gRPC's core, which leaves the call open with no status until its caller's deadline (a
        hop's stream has none): its iterator raises ``MalformedRequest`` instead, which the handler ends
        the stream with once what it was answering is written (``CoreStage.handle_stream``), or lets out
        to be answered here, after its last write."""
        count = self._count_malformed
        requests_received = self._metrics.method(name).requests
        yields = inspect.isasyncgenfunction(behavior)

        async def checked(requests: AsyncIterator[Any], context: aio.ServicerContext) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, malformed.Malformed):
                    count(name, request)
                    if yields:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed.MESSAGE)
                    raise MalformedRequest(malformed.MESSAGE)
                requests_received.inc()
                yield request

        if yields:

            async def stream(requests: AsyncIterator[Any], context: aio.ServicerContext) -> AsyncIterator[Any]:
                async for reply in behavior(checked(requests, context), context):
                    yield reply

            return stream

        async def unary(requests: AsyncIterator[Any], context: aio.ServicerContext) -> Any:
            try:
                return await behavior(checked(requests, context), context)
            except MalformedRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        return unary

    def _wrap(self, name: str, behavior: Behavior) -> Behavior:
        m = self._metrics.method(name)
        fail, ended = self._fail, self._ended
        refusable = not name.startswith(("grpc.", "InfoService/"))  # health and reflection answer to the end

        async def handle(request: Any, context: aio.ServicerContext) -> Any:
            m.requests.inc()
            m.in_flight.inc()
            self.active += 1
            start = time.perf_counter()
            try:
                if self.stopping and refusable:
                    raise StageUnavailable(f"{name}: the server is stopping")
                reply = await behavior(request, context)
            except RecpipeError as e:
                await fail(name, context, code_for(e), clip(e, MAX_DETAILS))
            except aio.AbortError:
                raise  # the handler aborted with its own status: nothing to map
            except asyncio.CancelledError:
                ended(name, context, "cancelled while it was being handled")
                raise
            except Exception as e:
                log.exception("%s failed", name)
                await fail(name, context, grpc.StatusCode.INTERNAL,
                           clip(f"{name}: internal error ({type(e).__name__}: {e})", MAX_DETAILS))
            else:
                if _expired(context):
                    ended(name, context, "answered after its deadline")
                    raise asyncio.CancelledError
                return reply
            finally:
                m.latency.observe(time.perf_counter() - start)
                m.in_flight.dec()
                self.active -= 1

        return handle

    async def _fail(self, name: str, context: aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
        """End the call with ``code``: count it, log it as counts if it is an expected outcome, and send
        the status while the caller still waits for it (else end it as cancelled, sending nothing)."""
        self._metrics.error(name, code.name)
        expired = _expired(context)
        outcome = _EXPECTED.get(code)
        if outcome is not None:
            self._metrics.outcomes.record(Outcome.EXPIRED if expired else outcome, name, details)
        if expired:
            raise asyncio.CancelledError
        try:
            await context.abort(code, details)
        except aio.InternalError:
            # gRPC could not send the status: the call ended between the check above and the send (its
            # deadline passed, or its caller cancelled). Already counted; nothing else to do.
            raise asyncio.CancelledError from None

    def _ended(self, name: str, context: aio.ServicerContext, detail: str) -> None:
        """Count and log a call that ends without an answer: past its deadline, or cancelled by its caller."""
        outcome = Outcome.EXPIRED if _expired(context) else Outcome.CANCELLED
        self._metrics.error(name, outcome.code)
        self._metrics.outcomes.record(outcome, name, detail)


class _UnsentAnswers(logging.Filter):
    """gRPC's core logs an answer it could not send because its call had ended (the caller went away
    between the handler's return and the send) as an ERROR with a traceback, "ExecuteBatchError raised
    in core by servicer method [/...]": a client that disconnects with calls in flight wrote one per
    call. Such a record of a method one of this process's servers serves becomes a counted outcome of
    the first such server (a stage process has one; a test process may hold several of a kind) and is not
    logged (``ServingInterceptor.unsent``); any other passes as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.interceptors: weakref.WeakSet[ServingInterceptor] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ != "ExecuteBatchError":
            return True
        method = record.getMessage().partition("[")[2].partition("]")[0]
        for interceptor in list(self.interceptors):
            if interceptor.serves(method):
                interceptor.unsent(method)
                return False
        return True


_UNSENT = _UnsentAnswers()
logging.getLogger("grpc._cython.cygrpc").addFilter(_UNSENT)


def _expired(context: aio.ServicerContext) -> bool:
    """Whether the call's deadline has passed (its caller has stopped waiting for an answer)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def _is_async(behavior: Behavior | None) -> bool:
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)
