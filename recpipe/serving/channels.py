"""Client channels to recpipe stages.

``round_robin`` makes a channel to a ``dns:///host:port`` name that resolves to several addresses (a
scaled-out stage behind one DNS name), or to an ``ipv4:`` list of them (``recpipe serve --replicas``),
spread calls over all of them instead of pinning the first one (the default ``pick_first``). Message
limits are raised because 10,000 candidates' item features exceed gRPC's 4 MiB default.

Each channel makes its own connections: gRPC's default, a subchannel pool shared by the whole process,
gives every channel to one address the same connection, so all of locust's users (one process) would
reach one of the gateway's replicas behind its one port, which the kernel spreads by connection.
"""

from __future__ import annotations

import json

import grpc
from grpc import aio

from recpipe.config import normalize_target

__all__ = ["CHANNEL_OPTIONS", "make_blocking_channel", "make_channel", "normalize_target"]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: The shortest time between two resolutions of a channel's ``dns:///`` name (gRPC's default: 30 s).
DNS_MIN_RESOLUTION_INTERVAL_MS = 1000

_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})

CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.service_config", _SERVICE_CONFIG),
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly after a stage restarts instead of backing off for up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # This channel's own connections, not those of another channel to the same address (see above).
    ("grpc.use_local_subchannel_pool", 1),
    # A dns:/// name is resolved again when a connection drops (a server's max connection age, a replica
    # gone), at most once a second instead of gRPC's 30 s: so an age below 30 s finds new replicas that
    # much sooner (``recpipe.serving.connection_age``). Resolutions happen on such events only.
    ("grpc.dns_min_time_between_resolutions_ms", DNS_MIN_RESOLUTION_INTERVAL_MS),
)


def make_channel(target: str) -> aio.Channel:
    """An asyncio channel to ``target`` (``host:port``, ``:port`` for 127.0.0.1, or ``dns:///host:port``),
    round-robin balanced."""
    return aio.insecure_channel(normalize_target(target), options=list(CHANNEL_OPTIONS))


def make_blocking_channel(target: str) -> grpc.Channel:
    """The same as ``make_channel`` for synchronous callers (the CLI client, benchmarks)."""
    return grpc.insecure_channel(normalize_target(target), options=list(CHANNEL_OPTIONS))
