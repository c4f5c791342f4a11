"""Prometheus metrics for one server: requests, errors, latency histogram per RPC, and in-flight RPCs;
and the log of its expected non-OK outcomes, as counts (``recpipe.serving.outcomes``).

Each server gets its own ``CollectorRegistry`` so several servers can live in one process (tests, the
in-process chain) without their series colliding. Label children are cached per method: looking them up
costs microseconds that the request path should not pay.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from recpipe.serving.outcomes import LOG_EVERY_S, Outcome, OutcomeLog

#: the expected outcomes an entry's code stands for (a malformed entry is the caller's INVALID_ARGUMENT,
#: counted, but its message names the field: not a malformed message)
_ENTRY_OUTCOMES = {o.code: o for o in (Outcome.REFUSED, Outcome.DEADLINE, Outcome.CANCELLED)}

#: Seconds; spans a fast feature gather (100 µs) to a stalled call.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)


@dataclass(frozen=True)
class MethodMetrics:
    """The label children of one RPC method, resolved once."""

    requests: Counter
    latency: Histogram
    in_flight: Gauge


class ServerMetrics:
    """The metric families of one server (``stage`` is a constant label on every series), and ``outcomes``,
    the log of its expected non-OK outcomes (at most one line per kind per ``log_every_s``)."""

    def __init__(self, stage: str, log_every_s: float = LOG_EVERY_S) -> None:
        self.stage = stage
        self.outcomes = OutcomeLog(stage, log_every_s)
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "recpipe_requests", "RPCs received", ["stage", "method"], registry=self.registry
        )
        self._errors = Counter(
            "recpipe_errors", "RPCs that ended with a non-OK status (sent, or seen by a caller that timed out "
            "or cancelled)", ["stage", "method", "code"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "recpipe_request_latency_seconds", "Time inside the handler per RPC", ["stage", "method"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._in_flight = Gauge(
            "recpipe_in_flight_requests", "RPCs being handled now", ["stage", "method"], registry=self.registry
        )
        self._methods: dict[str, MethodMetrics] = {}
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None

    def method(self, method: str) -> MethodMetrics:
        found = self._methods.get(method)
        if found is None:
            found = MethodMetrics(
                requests=self._requests.labels(self.stage, method),
                latency=self._latency.labels(self.stage, method),
                in_flight=self._in_flight.labels(self.stage, method),
            )
            self._methods[method] = found
        return found

    def error(self, method: str, code: str) -> None:
        self._errors.labels(self.stage, method, code).inc()

    def entry_failed(self, method: str, code: str, details: str) -> None:
        """A batch or stream entry answered with ``code`` (its call itself is OK): counted as an error
        of ``method``, and logged as counts where it is an expected outcome, as a whole call would be."""
        self.error(method, code)
        outcome = _ENTRY_OUTCOMES.get(code)
        if outcome is not None:
            self.outcomes.record(outcome, method, details)

    def serve_http(self, host: str, port: int) -> int:
        """Expose ``/metrics`` over HTTP on ``host:port`` (0 picks a free port); returns the port."""
        self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        self.outcomes.flush()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
