"""Overload on real servers: a ranking stage that can do about 100 requests/s is sent Recommend calls
through the gateway at 300/s (3x its capacity) for 1 s, open loop (nobody waits for an answer before
sending the next). What is shed is refused at once with
RESOURCE_EXHAUSTED naming the stage; nothing surfaces as INTERNAL; ranking does no work for the refused;
and right after nothing is left queued. How fast a refusal comes back is measured by
the benchmark, with each stage in its own process: here all four servers and the client share one
process, and the refusal time mostly measures that.

The benchmark at full scale is ``recpipe querygen --mode open`` at 3x the SLO rate (BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence

import grpc
import numpy as np
import pytest
from toy_stages import ToyFeatureCore, ToyRankingCore, ToyRetrievalCore, ToyWorld

from recpipe.features.servicer import FeatureStage
from recpipe.gateway.options import GatewayOptions
from recpipe.gateway.servicer import GatewayStage
from recpipe.ranking.contract import RankQuery
from recpipe.ranking.servicer import RankingStage
from recpipe.retrieval.servicer import RetrievalStage
from recpipe.serving.batcher import BatchConfig
from recpipe.serving.server import ServerThread
from recpipe.v1 import recommend_pb2, recommend_pb2_grpc

DEADLINE_S = 1.0


class CountingRankingCore(ToyRankingCore):
    """Counts the candidates lists it ranks: work done, whoever still waits for it."""

    def __init__(self, world: ToyWorld) -> None:
        super().__init__(world)
        self.ranked = 0

    def rank_batch(self, queries: Sequence[RankQuery]) -> list[np.ndarray]:
        out = super().rank_batch(queries)
        self.ranked += len(queries)
        return out


@pytest.fixture()
def slow_chain():
    world = ToyWorld()
    ranking = CountingRankingCore(world)
    ranking.delay_s = 0.04  # 40 ms per batch of at most 4: ~100 requests/s
    batch = BatchConfig(max_batch=4, max_queue=16)
    with ServerThread() as st:
        f = st.start(FeatureStage(lambda: ToyFeatureCore(world), batch=batch))
        r = st.start(RetrievalStage(lambda: ToyRetrievalCore(world), batch=batch))
        k = st.start(RankingStage(lambda: ranking, workers=1, batch=batch))
        g = st.start(GatewayStage(f.address, r.address, k.address, GatewayOptions(max_in_flight=16)))
        yield g.address, ranking


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
    address, ranking = slow_chain
    outcomes = asyncio.run(_open_loop(address, 300.0, 300))
    codes = Counter(code for code, _, _ in outcomes)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, codes
    assert codes["OK"] >= 50 and codes["RESOURCE_EXHAUSTED"] >= 100, codes
    # what is not admitted is refused; a deadline running out is the exception, not the way load is shed
    assert codes["DEADLINE_EXCEEDED"] <= codes["RESOURCE_EXHAUSTED"] // 4, codes
    shed = [(s, d) for c, s, d in outcomes if c == "RESOURCE_EXHAUSTED"]
    assert all("ranking" in d or "gateway" in d for _, d in shed), {d for _, d in shed}
    # ranking did no work for whom it refused: at most the admitted ones, and one batch more at the end
    assert ranking.ranked <= codes["OK"] + codes["DEADLINE_EXCEEDED"] + 4, (ranking.ranked, codes)
    # After the burst nothing is left queued: five single requests are answered, and ranking's work
    # grows by exactly those five (a backlog still draining would add more).
    time.sleep(0.2)  # the last batch in flight (40 ms) ends
    before = ranking.ranked
    with grpc.insecure_channel(address) as channel:
        stub = recommend_pb2_grpc.RecommendServiceStub(channel)
        for i in range(5):
            stub.Recommend(recommend_pb2.RecommendRequest(user_id=i, num_candidates=20), timeout=DEADLINE_S)
    assert ranking.ranked == before + 5
