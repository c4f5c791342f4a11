"""A registry of two toy stages that live here, in the tests, not in ``recpipe``: served by the real
``recpipe serve`` machinery through ``$RECPIPE_REGISTRY=toy_registry:REGISTRY`` with no change to
``serving/``. ``toy`` serves FeatureService over a toy core sized by its own option (``--toy-users``);
``front`` is the entry stage and calls ``toy`` (so it gets a ``--toy`` target flag) and reports that
target in its GetInfo details."""

from __future__ import annotations

from dataclasses import dataclass

from toy_stages import ToyFeatureCore, ToyWorld

from recpipe.errors import UsageError
from recpipe.features.servicer import FeatureCoreLike, FeatureStage
from recpipe.serving.config import StageConfig
from recpipe.serving.options import StageOptions, option
from recpipe.serving.spec import Registry, StageSpec
from recpipe.serving.stage import Stage


@dataclass(frozen=True)
class ToyOptions(StageOptions):
    group = "toy stage"

    toy_users: int = option(60, help="users in the toy world")

    def __post_init__(self) -> None:
        if self.toy_users < 1:
            raise UsageError(f"--toy-users must be >= 1, got {self.toy_users}")


class ToyStage(FeatureStage):
    name = "toy"


class FrontStage(FeatureStage):
    name = "front"

    def __init__(self, *args, toy_target: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.toy_target = toy_target

    def describe(self, core: FeatureCoreLike) -> dict[str, str]:
        return {**super().describe(core), "toy": self.toy_target}


def _toy(cfg: StageConfig) -> Stage:
    opts = cfg.options
    assert isinstance(opts, ToyOptions)
    return ToyStage.over(lambda: ToyFeatureCore(ToyWorld(num_users=opts.toy_users)), cfg)


def _front(cfg: StageConfig) -> Stage:
    return FrontStage(lambda: ToyFeatureCore(ToyWorld()), workers=cfg.workers, toy_target=cfg.targets["toy"])


REGISTRY = Registry([
    StageSpec("toy", port_offset=1, build=_toy, options=ToyOptions),
    StageSpec("front", port_offset=0, build=_front, upstream=("toy",)),
])
