"""The feature stage as the serving machinery sees it: name, port, thread libraries, builder."""

from __future__ import annotations

from recpipe.features import NAME
from recpipe.serving.config import StageConfig
from recpipe.serving.spec import COMPUTE_NICE, StageSpec
from recpipe.serving.stage import Stage


def build(cfg: StageConfig) -> Stage:
    from recpipe.features.core import FeatureCore
    from recpipe.features.servicer import FeatureStage

    return FeatureStage.over(lambda: FeatureCore.load(cfg.models_dir, cfg.data_dir, threads=cfg.threads or None), cfg)


SPEC = StageSpec(NAME, port_offset=1, build=build, cost=1.6, nice=COMPUTE_NICE, threads=("polars",),
                 reads_models=True,
                 description="Polars-encoded user and item rows gathered by position, history aggregates")
