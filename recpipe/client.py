"""Python client of the Recommend gateway (what ``recpipe recommend`` uses).

    with RecommendClient("127.0.0.1:50051") as client:
        rec = client.recommend(user_id=42, num_candidates=500, num_results=10)
        rec.item_ids, rec.scores, rec.timing("rank").server_us

Errors come back as recpipe's domain errors: ``UnknownUser`` (NOT_FOUND), ``BadRequest``
(INVALID_ARGUMENT), ``StageUnavailable`` (UNAVAILABLE, naming the stage or the gateway),
``DeadlineExceeded``; see ``recpipe.serving.status``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from types import TracebackType

import grpc
import numpy as np

from recpipe.config import DEFAULT_HOST, DEFAULT_PORT, normalize_target
from recpipe.serving.channels import make_blocking_channel
from recpipe.serving.stage import StageInfo
from recpipe.serving.status import error_for
from recpipe.types import Recommendation, StageTiming
from recpipe.v1 import info_pb2, info_pb2_grpc, recommend_pb2, recommend_pb2_grpc

DEFAULT_TARGET = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
#: the batcher's split of server time, passed on where the gateway-side StageTiming has these fields
_SPLIT = tuple(f.name for f in dataclasses.fields(StageTiming) if f.name in ("queue_us", "compute_us", "batch_size"))


class RecommendClient:
    """A blocking client over one channel; ``timeout`` (seconds) is the default per-call deadline."""

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = 10.0) -> None:
        self.target = normalize_target(target)
        self.timeout = timeout
        self._channel = make_blocking_channel(target)
        self._stub = recommend_pb2_grpc.RecommendServiceStub(self._channel)
        self._info = info_pb2_grpc.InfoServiceStub(self._channel)

    def recommend(
        self, user_id: int, num_candidates: int = 0, num_results: int = 0, timeout: float | None = None
    ) -> Recommendation:
        request = recommend_pb2.RecommendRequest(
            user_id=user_id, num_candidates=num_candidates, num_results=num_results
        )
        t0 = time.perf_counter()
        try:
            reply = self._stub.Recommend(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise self._error(e, time.perf_counter() - t0) from None
        return Recommendation(
            item_ids=np.array(reply.item_ids, dtype=np.int64),
            scores=np.array(reply.scores, dtype=np.float32),
            timings=tuple(StageTiming(t.stage, t.server_us, t.observed_us, **{f: getattr(t, f, 0) for f in _SPLIT})
                          for t in reply.timings),
            model_version=reply.model_version,
        )

    def connect(self, timeout: float | None = None) -> str | None:
        """Wait until the channel connects, at most ``timeout`` seconds (default the client's): None once
        connected, else why not ("connection failed after 0.01 s", "no answer within 10.00 s"). A refused
        connection fails at once rather than retrying until the timeout, as querygen's check does."""
        limit = timeout or self.timeout or 10.0
        done = threading.Event()
        seen: list[grpc.ChannelConnectivity] = []

        def watch(state: grpc.ChannelConnectivity) -> None:
            if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                         grpc.ChannelConnectivity.SHUTDOWN):
                seen.append(state)
                done.set()

        t0 = time.perf_counter()
        self._channel.subscribe(watch, try_to_connect=True)
        try:
            done.wait(limit)
        finally:
            self._channel.unsubscribe(watch)
        waited = time.perf_counter() - t0
        if seen and seen[0] is grpc.ChannelConnectivity.READY:
            return None
        return f"connection failed after {waited:.2f} s" if seen else f"no answer within {waited:.2f} s"

    def info(self, timeout: float | None = None) -> StageInfo:
        """What the server at ``target`` says about itself (any recpipe server answers this)."""
        t0 = time.perf_counter()
        try:
            i = self._info.GetInfo(info_pb2.GetInfoRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise self._error(e, time.perf_counter() - t0) from None
        return StageInfo(i.stage, i.device, i.model_version, i.threads, dict(i.details))

    def _error(self, e: grpc.RpcError, waited_s: float) -> Exception:
        code = e.code()  # type: ignore[attr-defined]
        details = e.details() or code.name  # type: ignore[attr-defined]
        # gRPC's own "failed to connect to all addresses; ..." / "connections to all backends failing; last
        # error: ...": nothing answered there. An UNAVAILABLE the gateway sent keeps its own words: a stage
        # down ("ranking unavailable at ..." may quote such an error), still starting, stopping.
        if code == grpc.StatusCode.UNAVAILABLE and "unavailable at" not in details and (
                "last error: " in details or "failed to connect" in details.lower()):
            last = details.rpartition("last error: ")[2]
            return error_for(code, f"cannot reach the gateway at {self.target} (gave up after {waited_s:.2f} s: "
                                   f"{last}); is `recpipe serve` running there?")
        return error_for(code, details)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RecommendClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
