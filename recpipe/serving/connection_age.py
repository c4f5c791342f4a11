"""How long a server keeps a client connection: gRPC's ``max_connection_age`` and its grace.

A client resolves a ``dns:///`` name when it connects and again only when a connection drops, so a
long-lived channel never sees replicas added later. A server that closes each connection after a
while (GOAWAY, calls in flight get the grace) makes its clients reconnect and re-resolve (gRPC
proposal A9). ``recpipe serve --max-connection-age/--max-connection-age-grace`` set it, else the
environment; every ``StageServer`` applies it. Kept apart from ``server`` so the CLI reads the
defaults without importing gRPC.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from recpipe.errors import UsageError

#: Environment variables behind ``recpipe serve --max-connection-age/--max-connection-age-grace``.
MAX_CONNECTION_AGE_ENV = "RECPIPE_MAX_CONNECTION_AGE"
MAX_CONNECTION_AGE_GRACE_ENV = "RECPIPE_MAX_CONNECTION_AGE_GRACE"
#: 30 s: a replica added to a name gets traffic at each client's next reconnect, so within about
#: that long (BENCHMARKS.md, issue 22). A shorter age finds it sooner: recpipe's channels re-resolve at
#: most once a second (``channels.DNS_MIN_RESOLUTION_INTERVAL_MS``; gRPC's own minimum, 30 s, made a
#: 5 s age find the replica at 30 s too). A reconnect every 30 s per client and server is one TCP +
#: HTTP/2 handshake, and calls in flight are not failed.
DEFAULT_MAX_CONNECTION_AGE_S = 30.0
#: 10 s: the default deadline of recpipe's clients (recommend, querygen), so the connection is only
#: closed under a call that has already outlived its caller.
DEFAULT_MAX_CONNECTION_AGE_GRACE_S = 10.0


@dataclass(frozen=True)
class ConnectionAge:
    """Close a client connection after ``max_age_s`` (0 = never) with ``grace_s`` for RPCs in flight."""

    max_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S
    grace_s: float = DEFAULT_MAX_CONNECTION_AGE_GRACE_S

    def __post_init__(self) -> None:
        for flag, value in (("--max-connection-age", self.max_age_s), ("--max-connection-age-grace", self.grace_s)):
            if not (math.isfinite(value) and value >= 0):
                raise UsageError(f"{flag} must be a finite number of seconds >= 0, got {value}")

    @classmethod
    def from_env(cls) -> ConnectionAge:
        """From ``$RECPIPE_MAX_CONNECTION_AGE`` and ``$RECPIPE_MAX_CONNECTION_AGE_GRACE`` (seconds), each
        defaulting to the values above; ``UsageError`` for a value that is not a number."""
        values = []
        for env, default in ((MAX_CONNECTION_AGE_ENV, DEFAULT_MAX_CONNECTION_AGE_S),
                             (MAX_CONNECTION_AGE_GRACE_ENV, DEFAULT_MAX_CONNECTION_AGE_GRACE_S)):
            text = os.environ.get(env, "").strip()
            try:
                values.append(float(text) if text else default)
            except ValueError:
                raise UsageError(f"${env} must be a number of seconds, got {text!r}") from None
        return cls(*values)

    def options(self) -> list[tuple[str, object]]:
        if self.max_age_s == 0:
            return []
        return [("grpc.max_connection_age_ms", max(1, round(self.max_age_s * 1000))),
                ("grpc.max_connection_age_grace_ms", round(self.grace_s * 1000))]
