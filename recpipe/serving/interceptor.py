"""The one server interceptor: domain errors -> gRPC status codes, plus per-RPC metrics.

Every unary-unary handler is wrapped once per method (the wrapper is cached, so a request pays one dict
lookup, not a handler rebuild). A ``RecpipeError`` escaping a handler becomes its status code from
``recpipe.serving.status``; anything else becomes INTERNAL with a log line carrying the traceback, and
the process keeps serving. Streaming handlers (health Watch, reflection) pass through untouched.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from recpipe.errors import RecpipeError
from recpipe.serving.metrics import ServerMetrics
from recpipe.serving.status import code_for

log = logging.getLogger(__name__)

Behavior = Callable[[Any, aio.ServicerContext], Awaitable[Any]]


class ServingInterceptor(aio.ServerInterceptor):
    """Maps errors to status codes and records requests, errors, latency and in-flight per method."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

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
        if (
            handler is None
            or handler.unary_unary is None
            or not inspect.iscoroutinefunction(handler.unary_unary)
        ):
            return handler
        wrapped = grpc.unary_unary_rpc_method_handler(
            self._wrap(method.lstrip("/").removeprefix("recpipe.v1."), handler.unary_unary),  # type: ignore[arg-type]
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        self._wrapped[method] = wrapped
        return wrapped

    def _wrap(self, name: str, behavior: Behavior) -> Behavior:
        m = self._metrics.method(name)
        metrics = self._metrics

        async def handle(request: Any, context: aio.ServicerContext) -> Any:
            m.requests.inc()
            m.in_flight.inc()
            start = time.perf_counter()
            try:
                return await behavior(request, context)
            except RecpipeError as e:
                code = code_for(e)
                metrics.error(name, code.name)
                await context.abort(code, str(e))
            except (asyncio.CancelledError, aio.AbortError):
                # The client went away, or the handler aborted with its own status: nothing to map.
                raise
            except Exception as e:
                log.exception("%s failed", name)
                metrics.error(name, grpc.StatusCode.INTERNAL.name)
                await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error ({type(e).__name__}: {e})")
            finally:
                m.latency.observe(time.perf_counter() - start)
                m.in_flight.dec()

        return handle
