"""The whole chain inside one process, for tests, benchmarks and notebooks, built from the registry.

- ``start_chain``: every registered stage as a gRPC server on a free loopback port, on a
  ``ServerThread`` (real sockets and serialisation, no separate processes);
- ``local_chain``: the gateway's ``Chain`` over the cores called directly (no gRPC), the baseline
  ``recpipe bench chain`` puts the gRPC chain against. Each local client calls the core's own entry
  point (``augment_user``, ``retrieve``, ``rank`` ...), which checks its arguments through the stage's
  contract as a servicer would, and times it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from recpipe.config import DEFAULT_HOST
from recpipe.gateway.chain import Chain
from recpipe.ranking import NAME as RANKING
from recpipe.ranking.options import RankingOptions
from recpipe.serving.batcher import BatchConfig
from recpipe.serving.options import StageOptions
from recpipe.serving.server import ServerThread, StageServer
from recpipe.stages import REGISTRY
from recpipe.types import ItemFeatures, StageResult, UserFeatures

if TYPE_CHECKING:
    from recpipe.features.core import FeatureCore
    from recpipe.ranking.core import RankingCore
    from recpipe.retrieval.core import RetrievalCore

T = TypeVar("T")

#: The in-process chain ranks in fp32, the library's default, so that its answers are those of the cores
#: called directly (``local_chain``) on any CPU; ``recpipe serve`` picks a precision per machine.
IN_PROCESS_OPTIONS: dict[str, StageOptions] = {RANKING: RankingOptions(precision="fp32")}


@dataclass(frozen=True)
class ChainServers:
    """Every registered stage started by ``start_chain``, by name (``chain.gateway``, ``chain["ranking"]``)."""

    servers: dict[str, StageServer]

    def __getattr__(self, name: str) -> StageServer:
        try:
            return self.__dict__["servers"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, name: str) -> StageServer:
        return self.servers[name]

    @property
    def targets(self) -> dict[str, str]:
        return {name: s.address for name, s in self.servers.items()}


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
    """Start every stage of the registry, upstream first, each on a free port of ``host`` with its
    stages' targets, loaded and SERVING, on ``servers``' loop, with ``IN_PROCESS_OPTIONS`` or each
    stage's default options."""
    mport = 0 if metrics else None
    started: dict[str, StageServer] = {}
    for spec in REGISTRY:
        cfg = REGISTRY.config(spec.name, models_dir=Path(models_dir), data_dir=Path(data_dir), host=host,
                              device=device, workers=workers, batch=batch,
                              targets={u: started[u].address for u in spec.upstream},
                              options=IN_PROCESS_OPTIONS.get(spec.name) or spec.options())
        started[spec.name] = servers.start(REGISTRY.build(cfg), host=host, metrics_port=mport)
    return ChainServers(started)


def _timed(fn: Callable[[], T], model_version: str = "") -> StageResult[T]:
    start = time.perf_counter_ns()
    value = fn()
    return StageResult(value, (time.perf_counter_ns() - start) // 1000, model_version, batch_size=1)


class LocalFeatureClient:
    def __init__(self, core: FeatureCore) -> None:
        self.core = core

    async def augment_user(self, user_id: int, timeout: float | None) -> StageResult[UserFeatures]:
        return _timed(lambda: self.core.augment_user(user_id))

    async def augment_items(self, user_id: int, item_ids: np.ndarray, timeout: float | None) -> StageResult[ItemFeatures]:
        return _timed(lambda: self.core.augment_items(user_id, item_ids))


class LocalRetrievalClient:
    def __init__(self, core: RetrievalCore) -> None:
        self.core = core

    async def retrieve(self, user: UserFeatures, k: int, timeout: float | None) -> StageResult[np.ndarray]:
        return _timed(lambda: self.core.retrieve(user, k).item_ids, self.core.model_version)


class LocalRankingClient:
    def __init__(self, core: RankingCore) -> None:
        self.core = core

    async def rank(self, user: UserFeatures, items: ItemFeatures, timeout: float | None) -> StageResult[np.ndarray]:
        return _timed(lambda: self.core.rank(user, items), self.core.model_version)


def local_chain(models_dir: Path, data_dir: Path, *, device: str = "cpu") -> Chain[UserFeatures, ItemFeatures]:
    """The chain over the real cores, called in process (loads the whole model repository)."""
    from recpipe.features.core import FeatureCore
    from recpipe.ranking.core import RankingCore
    from recpipe.retrieval.core import RetrievalCore

    return Chain(
        LocalFeatureClient(FeatureCore.load(models_dir, data_dir)),
        LocalRetrievalClient(RetrievalCore.load(models_dir, device=device)),
        LocalRankingClient(RankingCore.load(models_dir, device=device)),
    )
