"""A reusable locust User for gRPC services, timed by a client interceptor.

Locust's own gRPC example does the same: a ``grpc.UnaryUnaryClientInterceptor`` times every unary call
with ``perf_counter`` and fires one locust ``request`` event per call, so tasks just call the stub.
Subclass :class:`GrpcUser`, set ``stub_class``, and call ``self.stub.Method(request)`` in tasks;
a failed call raises ``grpc.RpcError`` in the task *after* it has been recorded as a failure whose
error names the status code (``NOT_FOUND: user 7 ...``), so a task catches it only to skip follow-up work.

gRPC's C core blocks in its own threads, which gevent cannot switch away from; ``init_gevent()``
makes gRPC cooperate with gevent's loop, so one locust process can keep many calls in flight. It must
run before any channel exists, hence at import. Locust imports every ``.py`` under ``-f loadtest/``
as its own module, so this file may run twice; ``init_gevent()`` tolerates that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User
from locust.env import Environment
from locust.exception import LocustError
from workload import WorkloadError, parse_target

from recpipe.serving.channels import make_blocking_channel

grpc_gevent.init_gevent()


class GrpcStatusError(Exception):
    """A failed gRPC call as locust records it: the status code first, so failures group by code."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details or ""


class LocustInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Fires one locust request event per unary call: name = the RPC method, time = wall clock."""

    def __init__(self, environment: Environment, request_type: str = "grpc") -> None:
        self.env = environment
        self.request_type = request_type

    def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], Any],
        client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        method = client_call_details.method
        name = (method.decode() if isinstance(method, bytes) else method).rsplit("/", 1)[-1]
        start = time.perf_counter()
        # For a blocking stub call the continuation returns once the answer (or the error) is in.
        call = continuation(client_call_details, request)
        exception: Exception | None = None
        length = 0
        try:
            length = call.result().ByteSize()
        except grpc.RpcError as e:
            code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
            details = e.details() if callable(getattr(e, "details", None)) else str(e)
            exception = GrpcStatusError(code, details)
        self.env.events.request.fire(
            request_type=self.request_type,
            name=name,
            response_time=(time.perf_counter() - start) * 1000.0,
            response_length=length,
            exception=exception,
            context={},
        )
        return call


class GrpcUser(User):
    """A locust User holding one intercepted channel and a stub to ``self.target``.

    ``self.target`` comes from locust's ``--host`` (``grpc://h:p``, ``h:p`` or a gRPC target URI such
    as ``dns:///h:p``), else from ``$RECPIPE_TARGET``. The channel uses the ``round_robin`` policy, so a
    target resolving to several addresses (a scaled-out gateway) gets load on all of them.
    """

    abstract = True
    stub_class: ClassVar[type | None] = None

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        if self.stub_class is None:
            raise LocustError(f"{type(self).__name__}.stub_class must be set")
        try:
            self.target = parse_target(self.host)
        except WorkloadError as e:
            raise LocustError(str(e)) from e
        self._channel = make_blocking_channel(self.target)
        self.channel = grpc.intercept_channel(self._channel, LocustInterceptor(environment))
        self.stub = self.stub_class(self.channel)
        #: the same service without the interceptor: for set-up calls that must not count as load
        self.raw_stub = self.stub_class(self._channel)

    def on_stop(self) -> None:
        self._channel.close()
