"""The gateway as the serving machinery sees it: the entry stage, its admission option, the stages it calls."""

from __future__ import annotations

from recpipe.gateway import NAME, UPSTREAM
from recpipe.gateway.options import GatewayOptions
from recpipe.serving.config import StageConfig
from recpipe.serving.spec import StageSpec
from recpipe.serving.stage import Stage


def build(cfg: StageConfig) -> Stage:
    from recpipe.gateway.servicer import GatewayStage

    opts = cfg.options
    assert isinstance(opts, GatewayOptions)
    features, retrieval, ranking = (cfg.targets[name] for name in UPSTREAM)
    return GatewayStage(features, retrieval, ranking, opts)


SPEC = StageSpec(NAME, port_offset=0, build=build, cost=2.5, options=GatewayOptions, upstream=UPSTREAM,
                 description="the chain: AugmentUser -> Retrieve -> AugmentItems -> Rank")
