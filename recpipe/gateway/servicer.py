"""RecommendService over gRPC: the gateway stage. Converts the request's deadline and the chain's
``Recommendation`` to and from protobuf; the chain itself is ``recpipe.gateway.chain``."""

from __future__ import annotations

import functools
import time

from grpc import aio

from recpipe.errors import StageUnavailable
from recpipe.gateway import NAME, UPSTREAM
from recpipe.gateway.admission import Admission
from recpipe.gateway.chain import Chain
from recpipe.gateway.clients import GrpcFeatureClient, GrpcRankingClient, GrpcRetrievalClient
from recpipe.gateway.hops import replica_targets
from recpipe.gateway.options import GatewayOptions
from recpipe.gateway.readiness import RIDE_THROUGH_S, ChainReadiness
from recpipe.serving.affinity import chain_cores
from recpipe.serving.stage import ReadinessWatch, Stage, StageInfo, check_deadline
from recpipe.types import Recommendation
from recpipe.v1 import recommend_pb2, recommend_pb2_grpc

SERVICE_NAME = recommend_pb2.DESCRIPTOR.services_by_name["RecommendService"].full_name


#: The largest request the gateway reads. A RecommendRequest is three varints (33 bytes at most), and the
#: other services every server hosts take as little; the chain's 64 MiB let a client park 64 MiB of unknown
#: fields per call in the gateway (8 such calls at once: 89 MB -> 1.15 GB) and be answered OK.
MAX_REQUEST_BYTES = 64 * 1024


class GatewayStage(Stage):
    name = NAME
    service_names = (SERVICE_NAME,)
    max_request_bytes = MAX_REQUEST_BYTES

    def __init__(self, features: str, retrieval: str, ranking: str, options: GatewayOptions | None = None) -> None:
        """The gateway over the stages at these gRPC targets (``UPSTREAM``, in that order)."""
        self.targets = dict(zip(UPSTREAM, (features, retrieval, ranking), strict=True))
        self.options = options or GatewayOptions()
        self.admission = Admission(self.options.max_in_flight)
        self.chain: Chain | None = None
        self._readiness: ChainReadiness | None = None
        self._clients: tuple[GrpcFeatureClient, GrpcRetrievalClient, GrpcRankingClient] | None = None
        #: GetInfo's ``upstream_wait_us``: the wait ``load`` resolved, and from what
        self._upstream_wait = ""

    def add_to_server(self, server: aio.Server) -> None:
        recommend_pb2_grpc.add_RecommendServiceServicer_to_server(self, server)  # type: ignore[arg-type]

    async def load(self) -> None:
        """Open the stage channels (inside the server's event loop; they connect lazily and reconnect
        by themselves when a stage restarts)."""
        processes, cores = self.chain_processes(), chain_cores()  # the machine's, not its own --cpus
        hops = self.options.hops(processes, cores)
        self._upstream_wait = (f"{hops.upstream_wait_us} ({self.options.hop_upstream_wait_us}: {processes} processes, "
                               f"{cores} cores)")
        clients = (
            GrpcFeatureClient(self.targets["features"], hops=hops),
            GrpcRetrievalClient(self.targets["retrieval"], hops=hops),
            GrpcRankingClient(self.targets["ranking"], hops=hops),
        )
        self._clients = clients
        self.chain = chain = Chain(*clients)
        features, retrieval, ranking = clients
        # each step's hop may wait for the queries at the step before it, which reach it next
        # (``--hop-upstream-wait-us``); the first step has none. A query alone in the gateway sends at once.
        for step, hop in enumerate((features.hops["AugmentUser"], retrieval.hops["Retrieve"],
                                    features.hops["AugmentItems"], ranking.hops["Rank"])):
            if step:
                hop.upstream = functools.partial(chain.between, step - 1, step)
            chain.on_pass[step] = hop.nudge
            hop.alone = chain.alone

    def chain_processes(self) -> int:
        """The chain's serving processes as this gateway knows them: itself and every replica its targets
        list (what ``--hop-upstream-wait-us auto`` weighs against the cores)."""
        return 1 + sum(len(replica_targets(target)) for target in self.targets.values())

    def readiness(self) -> ReadinessWatch | None:
        """The gateway is SERVING only while every stage it calls is (``recpipe.gateway.readiness``)."""
        if self._clients is None:
            return None
        channels = tuple(client.replica_channels for client in self._clients)
        passable = {name: client.replica_ok for name, client in zip(UPSTREAM, self._clients, strict=True)
                    if len(client.replica_ok) > 1}
        self._readiness = ChainReadiness(dict(zip(UPSTREAM, channels, strict=True)), passable)
        return self._readiness.run

    def info(self) -> StageInfo:
        version = self.chain.model_version if self.chain is not None else ""
        hops = {f"hop_{name}": f"{hop.calls} calls in {hop.batches} batch calls ({hop.sent_alone} of a lone query, "
                                f"up to {hop.config.max_batch}, {hop.max_in_flight} out at once)"
                for client in (self._clients or ()) for name, hop in client.hops.items()}
        wait = {"upstream_wait_us": self._upstream_wait} if self._upstream_wait else {}
        streams = [s for client in (self._clients or ()) for s in client.streams]
        transport = self.options.hop_transport
        if streams:  # none where every target is a dns: name (``GrpcFeatureClient``'s routes)
            transport += (f" ({sum(s.opened for s in streams)} streams opened, "
                          f"{sum(s.resent for s in streams)} calls sent again)")
        return StageInfo(self.name, "cpu", version, 1, {**self.targets, "max_in_flight": str(self.admission.max_in_flight),
                                                         **hops, **wait, "transport": transport})

    async def _recommend(self, request: recommend_pb2.RecommendRequest, deadline: float | None) -> Recommendation:
        """The chain's answer. While the health checks see a stage down (killed, frozen) the query waits
        for it to come back, ``RIDE_THROUGH_S`` at most and never past the last tenth of its time: a
        killed stage's standby is back in 0.3-0.5 s, so the query is answered late rather than refused;
        a stage down longer fails the query UNAVAILABLE, before its deadline. A query whose stage went
        down under it (UNAVAILABLE with no replica left to take its call, ``recpipe.gateway.hops``) waits
        for the next round of checks, then the same way, and runs once more: the stages only read."""
        assert self.chain is not None
        now = time.monotonic()
        until = now + RIDE_THROUGH_S if deadline is None else now + min(RIDE_THROUGH_S, (deadline - now) * 0.9)
        for attempt in (0, 1):
            if self._readiness is not None:
                down = await self._readiness.ride_through(until)
                if down is not None:
                    name, status = down
                    raise StageUnavailable(
                        f"{name} unavailable at {self.targets[name]}: {status} (the gateway's health check)")
            try:
                return await self.chain.recommend(
                    int(request.user_id), int(request.num_candidates), int(request.num_results), deadline)
            except StageUnavailable:
                if attempt or self._readiness is None or time.monotonic() >= until:
                    raise
                await self._readiness.next_round(until)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._clients is not None:
            for client in self._clients:
                await client.close()

    async def Recommend(
        self, request: recommend_pb2.RecommendRequest, context: aio.ServicerContext
    ) -> recommend_pb2.RecommendResponse:
        deadline = check_deadline(context, self.name)
        if self.chain is None:
            raise StageUnavailable("gateway: still starting")
        started = self.admission.admit(deadline)
        completed = False
        try:
            rec = await self._recommend(request, deadline)
            completed = True
        finally:
            self.admission.release(started, completed)
        return recommend_pb2.RecommendResponse(
            item_ids=rec.item_ids.tolist(),
            scores=rec.scores.tolist(),
            timings=[recommend_pb2.StageTiming(stage=t.stage, server_us=t.server_us, observed_us=t.observed_us,
                                               queue_us=t.queue_us, compute_us=t.compute_us, batch_size=t.batch_size)
                     for t in rec.timings],
            model_version=rec.model_version,
        )
