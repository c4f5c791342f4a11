"""The gateway's health is the chain's readiness: SERVING only while every stage it calls is SERVING.

``ChainReadiness.run`` asks each stage's gRPC health service (``Check``, service "") over the very
channel the chain calls it on, every ``INTERVAL_S`` (``NOT_READY_INTERVAL_S`` while the chain is not
ready, so it turns SERVING promptly once the stages have loaded), and reports a change whenever the
answer for the chain as a whole changes. A stage that answers anything but SERVING, that does not
answer within ``TIMEOUT_S``, or that cannot be reached, makes the chain not ready. Asking over the
chain's own channels means SERVING also proves those channels are connected: the first Recommend after
SERVING does not meet a channel still backing off from an earlier failed connect.

A stage run as several replicas is asked on each replica's own channel (the ones its hops send on),
and is SERVING while any replica is: the hops pass over a replica that is gone, so one replica killed
or restarting must not turn the whole chain away (a check over the balanced channel could land on the
dead replica in the moment before its channel noticed, and the gateway then refused every call until
the next check). The checks also tell the hops which replicas to pass over (``passable``): one that
answers NOT_SERVING (draining on stop) or gave no answer to its last check (frozen: its connection
stays up, so the hop's own channel check cannot tell, and each batch sent to it waited out its
deadline, a new one as soon as the last had expired).

Polling rather than ``Watch``: a Watch stream says nothing while a stage is frozen (SIGSTOP, a hung
event loop), since its connection stays open; a Check with a deadline notices. A channel that loses its
connection (the stage exited or was killed) is checked at once rather than at the next poll: the
supervisor's standby can take a killed stage's port in well under ``INTERVAL_S``, and the gateway
should still have said NOT_SERVING while nothing listened there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recpipe.serving.waits import wait_event

log = logging.getLogger(__name__)

#: Seconds between health checks while the chain is ready, and while it is not.
INTERVAL_S = 0.5
NOT_READY_INTERVAL_S = 0.1
#: A stage whose health check takes longer than this counts as not serving.
TIMEOUT_S = 1.0
#: Health checks in a row without an answer after which the gateway treats a stage as down.
SILENT_CHECKS = 2
NO_ANSWER = "no answer"
#: How long a query waits for a stage that is down to come back before it fails: a killed stage's warm
#: standby takes its port in 0.3-0.5 s (``recpipe.serving.supervisor``), and the queries of those moments
#: are answered late rather than refused (2-core VM, one ranking process killed twice under 100 q/s:
#: 108 of 2,400 queries UNAVAILABLE before, see ``recpipe.gateway.servicer``).
RIDE_THROUGH_S = 1.0

Report = Callable[[bool], Awaitable[None]]


class ChainReadiness:
    """Follows the health of the stages behind ``channels`` (stage name -> the chain's channels to its
    processes: one, or one per replica)."""

    def __init__(self, channels: Mapping[str, Sequence[aio.Channel]],
                 passable: Mapping[str, list[bool]] | None = None) -> None:
        """``passable``: per stage, one flag per replica (its hops' ``Route.up`` reads it), set False
        while that replica should be passed over (see the module doc) and True again once it answers."""
        self._channels = {name: list(replicas) for name, replicas in channels.items()}
        self._passable = dict(passable or {})
        self._stubs = {name: [health_pb2_grpc.HealthStub(c) for c in replicas] for name, replicas in self._channels.items()}
        #: stage -> "SERVING", or why not ("NOT_SERVING", "UNAVAILABLE: ...", "no answer in 1.0s").
        self.status: dict[str, str] = {name: "UNKNOWN" for name in channels}
        self.ready = False
        #: stage -> health checks in a row that got no answer
        self.silent: dict[str, int] = {}
        #: done when the round of checks under way ends (``next_round``)
        self._round: asyncio.Future[None] | None = None

    async def run(self, report: Report) -> None:
        """Check the stages until cancelled; ``report(ready)`` on every change (not ready at first)."""
        lost = asyncio.Event()
        watchers = [asyncio.create_task(_watch_connection(channel, lost))
                    for replicas in self._channels.values() for channel in replicas]
        try:
            while True:
                await self.check_once(report)
                await wait_event(lost, INTERVAL_S if self.ready else NOT_READY_INTERVAL_S)
                lost.clear()
        finally:
            for watcher in watchers:
                watcher.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def check_once(self, report: Report) -> bool:
        """One round of health checks over every stage; returns whether the chain is ready."""
        names = list(self._stubs)
        answers = await asyncio.gather(*(self._status(name) for name in names))
        self.status = dict(zip(names, answers, strict=True))
        self.silent = {n: self.silent.get(n, 0) + 1 if a.startswith(NO_ANSWER) else 0 for n, a in self.status.items()}
        if self._round is not None:
            if not self._round.done():
                self._round.set_result(None)
            self._round = None
        ready = all(s == "SERVING" for s in answers)
        if ready != self.ready:
            self.ready = ready
            if ready:
                log.info("chain ready: %s all SERVING", ", ".join(names))
            else:
                log.warning("chain not ready: %s", self.describe())
            await report(ready)
        return ready

    def down(self) -> tuple[str, str] | None:
        """The first stage known to be down, and why: its last health check could not reach it, or
        ``SILENT_CHECKS`` checks in a row got no answer (one late answer is a busy stage working off a
        backlog, not a frozen one); None while none is. A stage that answers NOT_SERVING (loading,
        draining) is not down: it refuses calls at once itself, with its own reason."""
        for name, status in self.status.items():
            if status.startswith("UNAVAILABLE") or self.silent.get(name, 0) >= SILENT_CHECKS:
                return name, status
        return None

    async def next_round(self, until: float) -> None:
        """Return once the next round of checks has ended, or at ``until`` (a ``time.monotonic()``
        instant). A channel that loses its connection starts a round at once."""
        if self._round is None:
            self._round = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._round), max(until - time.monotonic(), 0.0))

    async def ride_through(self, until: float) -> tuple[str, str] | None:
        """``down()``, after waiting until ``until`` at most for a stage that is down to come back (a
        round of checks at a time): None once none is down, else the stage still down and why."""
        while (down := self.down()) is not None and time.monotonic() < until:
            await self.next_round(until)
        return down

    def describe(self) -> str:
        """The stages that are not SERVING and why, e.g. "ranking UNAVAILABLE (connection refused)"."""
        return "; ".join(f"{name} {status}" for name, status in self.status.items() if status != "SERVING") or \
            "every stage SERVING"

    async def _status(self, name: str) -> str:
        """The stage's status: SERVING while any of its replicas is; else the most telling of theirs (an
        answer such as NOT_SERVING, then no answer, then unreachable)."""
        answers = await asyncio.gather(*(_check(stub) for stub in self._stubs[name]))
        flags = self._passable.get(name)
        if flags is not None:
            for i, answer in enumerate(answers):
                flags[i] = not (answer.startswith(NO_ANSWER) or _rank(answer) == 1)
        return min(answers, key=_rank)


def _rank(status: str) -> int:
    """How well a replica's status speaks for its stage (lowest first)."""
    if status == "SERVING":
        return 0
    if status.startswith(NO_ANSWER):
        return 2
    return 3 if status.startswith("UNAVAILABLE") else 1


async def _check(stub: health_pb2_grpc.HealthStub) -> str:
    """One process's health: "SERVING", another status's name, no answer in time, or the RPC's error."""
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
    except aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"{NO_ANSWER} in {TIMEOUT_S:g}s"
        return f"{e.code().name} ({(e.details() or '')[:120]})"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


async def _watch_connection(channel: aio.Channel, lost: asyncio.Event) -> None:
    """Set ``lost`` whenever ``channel`` leaves READY (its connection closed or broke)."""
    state = channel.get_state(try_to_connect=False)
    while True:
        await channel.wait_for_state_change(state)
        new = channel.get_state(try_to_connect=False)
        if state == grpc.ChannelConnectivity.READY and new != grpc.ChannelConnectivity.READY:
            lost.set()
        state = new
