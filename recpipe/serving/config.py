"""``recpipe serve`` configuration, built once from the flags and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from recpipe.config import DEFAULT_HOST, DEFAULT_PORTS
from recpipe.errors import UsageError

STAGE_NAMES: tuple[str, ...] = ("features", "retrieval", "ranking", "gateway")
#: The metrics endpoint of a stage on gRPC port P defaults to P + METRICS_PORT_OFFSET.
METRICS_PORT_OFFSET = 1000


@dataclass(frozen=True)
class StageConfig:
    """Everything one stage process needs.

    ``port`` 0 picks a free port; ``metrics_port`` None disables /metrics, 0 picks a free port.
    ``threads`` 0 leaves the libraries' defaults; ``workers`` 0 runs cores on the event loop, N > 0 on a
    pool of N threads. ``targets`` (gateway only) maps features/retrieval/ranking to gRPC targets.
    """

    stage: str
    models_dir: Path = Path("models")
    data_dir: Path = Path("data")
    host: str = DEFAULT_HOST
    port: int = 0
    metrics_port: int | None = None
    device: str = "auto"
    threads: int = 0
    workers: int = 0
    grace_s: float = 5.0
    targets: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stage not in STAGE_NAMES:
            raise UsageError(f"unknown stage {self.stage!r}: choose {', '.join(STAGE_NAMES)} or all")
        for name, value in (("port", self.port), ("metrics-port", self.metrics_port or 0)):
            if not 0 <= value <= 65535:
                raise UsageError(f"--{name} must be in 0..65535, got {value}")
        if self.threads < 0 or self.workers < 0:
            raise UsageError("--threads and --workers must be >= 0")
        if self.grace_s < 0:
            raise UsageError("--grace must be >= 0")
        if self.stage == "gateway":
            missing = [s for s in ("features", "retrieval", "ranking") if not self.targets.get(s)]
            if missing:
                raise UsageError(f"gateway needs targets for {', '.join(missing)}")


def default_targets(host: str) -> dict[str, str]:
    """Where the gateway finds the stages when started alone with the default ports."""
    return {s: f"{host}:{DEFAULT_PORTS[s]}" for s in ("features", "retrieval", "ranking")}
