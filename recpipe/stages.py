"""The registry of stages: the one place that knows which stages exist and how each is built.

``serving/`` (servers, supervisor, runner) knows a stage only as a ``recpipe.serving.stage.Stage``;
``recpipe serve``, the in-process chain (``recpipe.inprocess``) and the benches find stages here. Each
stage package owns its contract (``contract.py``), pure core (``core.py``), thin servicer
(``servicer.py``) and artifacts (``artifacts.py``); none imports another. Stage modules are imported
only when a stage is built, after ``--threads`` has been applied to the libraries it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from recpipe.serving import nvtx
from recpipe.serving import threads as thread_settings
from recpipe.serving.config import STAGE_NAMES, StageConfig
from recpipe.serving.stage import Stage


@dataclass(frozen=True)
class StageSpec:
    """A stage: its name, the compute libraries ``--threads`` configures for it, and its builder."""

    name: str
    torch: bool
    faiss: bool
    build: Callable[[StageConfig], Stage]


def _features(cfg: StageConfig) -> Stage:
    from recpipe.features.servicer import load_stage

    return load_stage(cfg.models_dir, cfg.data_dir, threads=cfg.threads or None, workers=cfg.workers,
                      batch=cfg.batch)


def _retrieval(cfg: StageConfig) -> Stage:
    from recpipe.retrieval.servicer import load_stage

    return load_stage(cfg.models_dir, device=cfg.device, threads=cfg.threads, workers=cfg.workers, batch=cfg.batch,
                      cuda_graphs=cfg.gpu.cuda_graphs, precision=cfg.gpu.precision, rescore=cfg.gpu.rescore)


def _ranking(cfg: StageConfig) -> Stage:
    from recpipe.ranking.servicer import load_stage

    return load_stage(cfg.models_dir, device=cfg.device, threads=cfg.threads, workers=cfg.workers, batch=cfg.batch,
                      cuda_graphs=cfg.gpu.cuda_graphs, embeddings=cfg.gpu.embeddings, precision=cfg.ranking_precision)


def _gateway(cfg: StageConfig) -> Stage:
    from recpipe.gateway.servicer import GatewayStage

    return GatewayStage(cfg.targets["features"], cfg.targets["retrieval"], cfg.targets["ranking"],
                        max_in_flight=cfg.max_in_flight)


REGISTRY: dict[str, StageSpec] = {
    "features": StageSpec("features", torch=False, faiss=False, build=_features),
    "retrieval": StageSpec("retrieval", torch=True, faiss=True, build=_retrieval),
    "ranking": StageSpec("ranking", torch=True, faiss=False, build=_ranking),
    "gateway": StageSpec("gateway", torch=False, faiss=False, build=_gateway),
}
assert tuple(REGISTRY) == STAGE_NAMES


def build_stage(cfg: StageConfig) -> Stage:
    """The stage ``cfg`` names, with its thread settings applied before its libraries are imported."""
    spec = REGISTRY[cfg.stage]
    if cfg.gpu.nvtx:
        nvtx.enable()
    if spec.name != "gateway":
        thread_settings.configure(cfg.threads, torch=spec.torch, faiss=spec.faiss)
    return spec.build(cfg)
