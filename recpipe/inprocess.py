"""The whole chain inside one process, for tests, benchmarks and notebooks, built from the registry.

- ``start_chain``: the four real stages as gRPC servers on free loopback ports, on a ``ServerThread``
  (real sockets and serialisation, no separate processes);
- ``local_chain``: the gateway's ``Chain`` over the cores called directly (no gRPC), the baseline
  ``recpipe bench chain`` puts the gRPC chain against. Each local client goes through the stage's
  contract (``*Query.checked``) and its batch entry point with a batch of one, as a servicer would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from recpipe.config import DEFAULT_HOST
from recpipe.gateway.chain import Chain, StageResult
from recpipe.serving.batcher import BatchConfig
from recpipe.serving.config import StageConfig
from recpipe.serving.inprocess import ServerThread
from recpipe.serving.server import StageServer
from recpipe.stages import build_stage
from recpipe.types import ItemFeatures, UserFeatures


@dataclass(frozen=True)
class ChainServers:
    """The four real stages started by ``start_chain``: their servers and addresses."""

    features: StageServer
    retrieval: StageServer
    ranking: StageServer
    gateway: StageServer

    @property
    def targets(self) -> dict[str, str]:
        return {name: getattr(self, name).address for name in ("gateway", "features", "retrieval", "ranking")}


def start_chain(
    servers: ServerThread,
    models_dir: Path,
    data_dir: Path,
    *,
    host: str = DEFAULT_HOST,
    device: str = "cpu",
    workers: int = 0,
    metrics: bool = False,
    batch: BatchConfig | None = None,
) -> ChainServers:
    """Start the real feature, retrieval and ranking stages and a gateway over them, all on free ports
    of ``host``, loaded and SERVING, on ``servers``' loop."""
    mport = 0 if metrics else None
    base = StageConfig("features", models_dir=Path(models_dir), data_dir=Path(data_dir), host=host, device=device,
                       workers=workers, batch=batch or BatchConfig())
    started: dict[str, StageServer] = {}
    for name in ("features", "retrieval", "ranking"):
        started[name] = servers.start(build_stage(replace(base, stage=name)), host=host, metrics_port=mport)
    targets = {name: s.address for name, s in started.items()}
    gateway = servers.start(build_stage(replace(base, stage="gateway", targets=targets)), host=host,
                            metrics_port=mport)
    return ChainServers(started["features"], started["retrieval"], started["ranking"], gateway)


def _us(start: int) -> int:
    return (time.perf_counter_ns() - start) // 1000


class LocalFeatureClient:
    def __init__(self, core: Any) -> None:
        from recpipe.features.contract import ItemsQuery, UserQuery

        self.core = core
        self._user, self._items = UserQuery, ItemsQuery

    async def augment_user(self, user_id: int, timeout: float | None) -> StageResult[UserFeatures]:
        start = time.perf_counter_ns()
        user = self.core.user_features(self._user.checked(user_id, self.core.limits))
        return StageResult(user, _us(start), batch_size=1)

    async def augment_items(self, user_id: int, item_ids: np.ndarray, timeout: float | None) -> StageResult[ItemFeatures]:
        start = time.perf_counter_ns()
        items = self.core.items_batch([self._items.checked(user_id, item_ids, self.core.limits)])[0]
        return StageResult(items, _us(start), batch_size=1)


class LocalRetrievalClient:
    def __init__(self, core: Any) -> None:
        from recpipe.retrieval.contract import RetrieveQuery

        self.core = core
        self._query = RetrieveQuery

    async def retrieve(self, user: UserFeatures, k: int, timeout: float | None) -> StageResult[np.ndarray]:
        start = time.perf_counter_ns()
        found = self.core.retrieve_batch([self._query.checked(user.dense, user.sparse, k, self.core.limits)])[0]
        return StageResult(found.item_ids, _us(start), self.core.model_version, batch_size=1)


class LocalRankingClient:
    def __init__(self, core: Any) -> None:
        from recpipe.ranking.contract import RankQuery

        self.core = core
        self._query = RankQuery

    async def rank(self, user: UserFeatures, items: ItemFeatures, timeout: float | None) -> StageResult[np.ndarray]:
        start = time.perf_counter_ns()
        query = self._query.checked(user.dense, user.sparse, items.dense, items.sparse, self.core.limits)
        scores = self.core.rank_batch([query])[0]
        return StageResult(scores, _us(start), self.core.model_version, batch_size=1)


def local_chain(models_dir: Path, data_dir: Path, *, device: str = "cpu") -> Chain[Any, Any]:
    """The chain over the real cores, called in process (loads the whole model repository)."""
    from recpipe.features.core import FeatureCore
    from recpipe.ranking.core import RankingCore
    from recpipe.retrieval.core import RetrievalCore

    return Chain(
        LocalFeatureClient(FeatureCore.load(models_dir, data_dir)),
        LocalRetrievalClient(RetrievalCore.load(models_dir, device=device)),
        LocalRankingClient(RankingCore.load(models_dir, device=device)),
    )
