"""The ranking stage as the serving machinery sees it: name, port, options, thread libraries, builder."""

from __future__ import annotations

from dataclasses import asdict

from recpipe.ranking import NAME
from recpipe.ranking.options import RankingOptions
from recpipe.serving.config import StageConfig
from recpipe.serving.spec import COMPUTE_NICE, StageSpec
from recpipe.serving.stage import Stage


def build(cfg: StageConfig) -> Stage:
    from recpipe.ranking.core import RankingCore
    from recpipe.ranking.servicer import RankingStage

    opts = cfg.options
    assert isinstance(opts, RankingOptions)
    # the forward's user buckets are warmed up to the batcher's largest batch (0: its auto)
    max_batch = cfg.batch.max_batch if cfg.batch is not None else 0
    return RankingStage.over(lambda: RankingCore.load(cfg.models_dir, device=cfg.device, max_batch=max_batch,
                                                      **asdict(opts)), cfg)


# gpu_cost: CPU per query under load with the model on a GPU, on the gateway's scale (cost 2.5): H200
# machine, 78cf8d1, 32 clients, ms per query: gateway 1.66, features 1.10, retrieval 0.92, ranking 0.96.
# own_cores: its batch forward is the chain's longest run of one thread, twice as slow sharing a core
# (``recpipe.serving.affinity``)
SPEC = StageSpec(NAME, port_offset=3, build=build, cost=4.7, gpu_cost=1.45, nice=COMPUTE_NICE, options=RankingOptions,
                 threads=("torch",), own_cores=True, reads_models=True,
                 description="DLRM over the candidates")
