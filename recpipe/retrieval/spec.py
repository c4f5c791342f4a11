"""The retrieval stage as the serving machinery sees it: name, port, options, thread libraries, builder."""

from __future__ import annotations

from dataclasses import asdict

from recpipe.retrieval import NAME
from recpipe.retrieval.options import RetrievalOptions
from recpipe.serving.config import StageConfig
from recpipe.serving.spec import COMPUTE_NICE, StageSpec
from recpipe.serving.stage import Stage


def loads(cfg: StageConfig) -> tuple[str, ...]:
    """FAISS always; torch unless the core runs on the CPU with the FAISS index (its tower folded)."""
    opts = cfg.options
    assert isinstance(opts, RetrievalOptions)
    return ("torch", "faiss") if opts.needs_torch(cfg.device) else ("faiss",)


def build(cfg: StageConfig) -> Stage:
    from recpipe.retrieval.core import RetrievalCore
    from recpipe.retrieval.servicer import RetrievalStage

    opts = cfg.options
    assert isinstance(opts, RetrievalOptions)
    return RetrievalStage.over(lambda: RetrievalCore.load(cfg.models_dir, device=cfg.device, **asdict(opts)), cfg)


# gpu_cost: CPU per query under load with the model on a GPU, on the gateway's scale (cost 2.5): H200
# machine, 78cf8d1, 32 clients, ms per query: gateway 1.66, features 1.10, retrieval 0.92, ranking 0.96.
SPEC = StageSpec(NAME, port_offset=2, build=build, cost=1.7, gpu_cost=1.4, nice=COMPUTE_NICE, options=RetrievalOptions,
                 threads=("torch", "faiss"), loads=loads, reads_models=True,
                 description="user tower -> query embedding -> FAISS / exact top-k")
