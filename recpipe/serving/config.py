"""One stage process's configuration, built once from the flags and passed down.

The settings every stage shares (addresses, device, threads, batching) are fields here; a stage's own
settings are its options dataclass (``recpipe/<stage>/spec.py``), carried in ``options``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from recpipe.config import DEFAULT_HOST
from recpipe.errors import UsageError
from recpipe.serving.batcher import BatchConfig
from recpipe.serving.options import StageOptions

#: A supervised stage whose health has not answered for this long is restarted (0 = never;
#: ``--unresponsive-timeout``): a health check answers in under a millisecond on loopback, so two seconds
#: of silence is a frozen process, and the restart is most of a frozen stage's outage.
DEFAULT_UNRESPONSIVE_S = 2.0
#: The metrics endpoint of a stage on gRPC port P defaults to P + METRICS_PORT_OFFSET.
METRICS_PORT_OFFSET = 1000


@dataclass(frozen=True)
class StageConfig:
    """Everything one stage process needs.

    ``port`` 0 picks a free port; ``metrics_port`` None disables /metrics, 0 picks a free port.
    ``threads`` 0 leaves the libraries' defaults; ``workers`` 0 runs core calls on the event loop when
    they are predicted short and on a thread otherwise (``recpipe.serving.inline``), N > 0 unbatched
    ones on a pool of N threads and batched ones on their batcher's thread.
    ``batch`` sets the dynamic batcher of the batched methods (None: the stage's declared default);
    ``targets`` maps each stage this one calls (its spec's ``upstream``) to a gRPC target; ``nvtx``
    marks each request step with an NVTX range; ``options`` are the stage's own settings; ``standby``:
    load, then wait to be activated before taking the port (``recpipe.serving.runner``).
    Replicas (``recpipe serve --replicas``): ``bind_after_load`` takes the port only once loaded, so a
    caller balancing over several replicas never picks one still loading; ``reuse_port`` shares
    ``port`` with the stage's other processes (SO_REUSEPORT: the kernel spreads the connections), and
    ``own_port`` (0: a free one) is where this process alone answers too, for its supervisor's health
    checks and GetInfo.
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
    batch: BatchConfig | None = None
    nvtx: bool = False
    options: StageOptions = field(default_factory=StageOptions)
    standby: bool = False
    bind_after_load: bool = False
    reuse_port: bool = False
    own_port: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("port", self.port), ("metrics-port", self.metrics_port or 0),
                            ("own-port", self.own_port or 0)):
            if not 0 <= value <= 65535:
                raise UsageError(f"--{name} must be in 0..65535, got {value}")
        if self.threads < 0 or self.workers < 0:
            raise UsageError("--threads and --workers must be >= 0")
        if self.grace_s < 0:
            raise UsageError("--grace must be >= 0")
