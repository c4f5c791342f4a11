"""Overload on real servers: a ranking stage that can do about 100 requests/s is sent Recommend calls
through the gateway at 300/s (3x its capacity) for 1 s, open loop (nobody waits for an answer before
sending the next). What is shed is refused at once with
RESOURCE_EXHAUSTED naming the stage; nothing surfaces as INTERNAL; no request waits past its deadline;
and the chain answers at its normal speed right after. How fast a refusal comes back is measured by
the benchmark, with each stage in its own process: here all four servers and the client share one
process, and the refusal time mostly measures that.

The benchmark at full scale is ``recpipe querygen --mode open`` at 3x the SLO rate (BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
import pytest
from toy_stages import ToyFeatureCore, ToyRankingCore, ToyRetrievalCore, ToyWorld

from recpipe.features.servicer import FeatureStage
from recpipe.gateway.options import GatewayOptions
from recpipe.gateway.servicer import GatewayStage
from recpipe.ranking.servicer import RankingStage
from recpipe.retrieval.servicer import RetrievalStage
from recpipe.serving.batcher import BatchConfig
from recpipe.serving.server import ServerThread
from recpipe.v1 import recommend_pb2, recommend_pb2_grpc

DEADLINE_S = 1.0


@pytest.fixture()
def slow_chain():
    world = ToyWorld()
    ranking = ToyRankingCore(world)
    ranking.delay_s = 0.04  # 40 ms per batch of at most 4: ~100 requests/s
    batch = BatchConfig(max_batch=4, max_queue=16)
    with ServerThread() as st:
        f = st.start(FeatureStage(lambda: ToyFeatureCore(world), batch=batch))
        r = st.start(RetrievalStage(lambda: ToyRetrievalCore(world), batch=batch))
        k = st.start(RankingStage(lambda: ranking, workers=1, batch=batch))
        g = st.start(GatewayStage(f.address, r.address, k.address, GatewayOptions(max_in_flight=16)))
        yield g.address


async def _open_loop(address: str, rate: float, n: int) -> list[tuple[str, float, str]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = recommend_pb2_grpc.RecommendServiceStub(channel)

        async def one(i: int) -> tuple[str, float, str]:
            t0 = time.perf_counter()
            try:
                await stub.Recommend(recommend_pb2.RecommendRequest(user_id=i % 60, num_candidates=20),
                                     timeout=DEADLINE_S)
                return "OK", time.perf_counter() - t0, ""
            except grpc.aio.AioRpcError as e:
                return e.code().name, time.perf_counter() - t0, e.details() or ""

        tasks = []
        start = time.perf_counter()
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
        return await asyncio.gather(*tasks)


def test_a_burst_past_capacity_is_shed_with_resource_exhausted_and_the_chain_recovers(slow_chain) -> None:
    outcomes = asyncio.run(_open_loop(slow_chain, 300.0, 300))
    codes = Counter(code for code, _, _ in outcomes)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, codes
    assert codes["OK"] >= 50 and codes["RESOURCE_EXHAUSTED"] >= 100, codes
    # what is not admitted is refused; a deadline running out is the exception, not the way load is shed
    assert codes["DEADLINE_EXCEEDED"] <= codes["RESOURCE_EXHAUSTED"] // 4, codes
    shed = [(s, d) for c, s, d in outcomes if c == "RESOURCE_EXHAUSTED"]
    assert all("ranking" in d or "gateway" in d for _, d in shed), {d for _, d in shed}
    # nobody is kept waiting past the deadline (+ scheduling slack)
    assert max(s for _, s, _ in outcomes) < DEADLINE_S + 0.25
    # right after the burst, single requests are answered at normal speed again
    time.sleep(0.2)
    with grpc.insecure_channel(slow_chain) as channel:
        stub = recommend_pb2_grpc.RecommendServiceStub(channel)
        t0 = time.perf_counter()
        for i in range(5):
            stub.Recommend(recommend_pb2.RecommendRequest(user_id=i, num_candidates=20), timeout=2)
        assert (time.perf_counter() - t0) / 5 < 0.2
