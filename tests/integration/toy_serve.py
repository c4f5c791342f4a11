"""A toy feature stage as its own OS process, for the supervisor tests (no model repository needed).

    python toy_serve.py PORT [--fail-at-start] [--delay SECONDS]

``--delay``: every AugmentUser call spends that long in the core (a long but legitimate call).
"""

from __future__ import annotations

import asyncio
import sys

from toy_stages import ToyFeatureCore, ToyWorld

from recpipe.features.servicer import FeatureStage
from recpipe.serving import runner
from recpipe.serving.config import StageConfig


def main(argv: list[str]) -> int:
    port = int(argv[0])
    if "--fail-at-start" in argv:
        print("toy stage: failing on purpose", file=sys.stderr)
        return 3
    delay_s = float(argv[argv.index("--delay") + 1]) if "--delay" in argv else 0.0

    def load() -> ToyFeatureCore:
        core = ToyFeatureCore(ToyWorld())
        core.delay_s = delay_s
        return core

    stage = FeatureStage(load)
    asyncio.run(runner.serve(StageConfig("features", port=port, grace_s=2.0), stage=stage))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
