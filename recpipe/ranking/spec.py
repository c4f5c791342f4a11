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
    return RankingStage.over(lambda: RankingCore.load(cfg.models_dir, device=cfg.device, **asdict(opts)), cfg)


SPEC = StageSpec(NAME, port_offset=3, build=build, cost=4.7, nice=COMPUTE_NICE, options=RankingOptions, threads=("torch",),
                 description="DLRM over the candidates")
