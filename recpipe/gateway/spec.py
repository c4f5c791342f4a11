"""The gateway as the serving machinery sees it: the entry stage, its admission option, the stages it calls."""

from __future__ import annotations

from dataclasses import dataclass

from recpipe.errors import UsageError
from recpipe.serving.config import StageConfig
from recpipe.serving.options import StageOptions, option
from recpipe.serving.spec import StageSpec
from recpipe.serving.stage import Stage

#: Recommend calls the gateway works on at once; more are refused with RESOURCE_EXHAUSTED.
DEFAULT_MAX_IN_FLIGHT = 512
#: The stages the chain calls (each reached through its target).
UPSTREAM = ("features", "retrieval", "ranking")
#: Which of them runs each timed step of a query (``recpipe.config.STEPS``).
STEP_STAGES = {"augment_user": "features", "retrieve": "retrieval", "augment_items": "features", "rank": "ranking"}


@dataclass(frozen=True)
class GatewayOptions(StageOptions):
    group = "gateway"

    max_in_flight: int = option(DEFAULT_MAX_IN_FLIGHT, help=f"gateway: Recommend calls in progress at most; more are "
                                                            f"refused with RESOURCE_EXHAUSTED (default {DEFAULT_MAX_IN_FLIGHT})")

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise UsageError(f"--max-in-flight must be >= 1, got {self.max_in_flight}")


def build(cfg: StageConfig) -> Stage:
    from recpipe.gateway.servicer import GatewayStage

    opts = cfg.options
    assert isinstance(opts, GatewayOptions)
    features, retrieval, ranking = (cfg.targets[name] for name in UPSTREAM)
    return GatewayStage(features, retrieval, ranking, opts)


SPEC = StageSpec("gateway", port_offset=0, build=build, options=GatewayOptions, upstream=UPSTREAM,
                 description="the chain: AugmentUser -> Retrieve -> AugmentItems -> Rank")
