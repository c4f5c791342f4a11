"""``recpipe serve`` configuration, built once from the flags and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from recpipe.config import (
    DEFAULT_HOST,
    DEFAULT_PORTS,
    DEFAULT_RESCORE,
    EMBEDDING_PLACEMENTS,
    MAX_RESCORE,
    RETRIEVAL_PRECISIONS,
)
from recpipe.errors import UsageError
from recpipe.serving.batcher import BatchConfig

STAGE_NAMES: tuple[str, ...] = ("features", "retrieval", "ranking", "gateway")
#: The metrics endpoint of a stage on gRPC port P defaults to P + METRICS_PORT_OFFSET.
METRICS_PORT_OFFSET = 1000
#: Recommend calls the gateway works on at once; more are refused with RESOURCE_EXHAUSTED.
DEFAULT_MAX_IN_FLIGHT = 512


def check_max_in_flight(value: int) -> int:
    """``--max-in-flight``, or ``UsageError`` (one check for the CLI, before any process starts, and
    for ``StageConfig``)."""
    if value < 1:
        raise UsageError(f"--max-in-flight must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class GpuConfig:
    """The GPU fast path (``recpipe serve --cuda-graphs/--no-cuda-graphs --retrieval-precision --rescore
    --embeddings --nvtx``).

    ``cuda_graphs``: replay a CUDA graph per bucketed batch shape for the ranking forward and the user
    tower (CUDA only; nothing changes on the CPU). ``precision``: the retrieval scan (auto = fp16 on
    CUDA, FAISS on the CPU); ``rescore``: the half-precision scan keeps rescore x k candidates and
    re-scores them in fp32 (0 = off). ``embeddings``: DLRM tables in device memory or in pinned host
    memory read by the GPU in place (CUDA only). ``nvtx``: NVTX ranges per stage step (CUDA only).
    The CUDA-only choices are checked against the machine by ``recpipe serve`` before anything starts.
    """

    cuda_graphs: bool = True
    precision: str = "auto"
    rescore: int = DEFAULT_RESCORE
    embeddings: str = "device"
    nvtx: bool = False

    def __post_init__(self) -> None:
        if self.precision not in RETRIEVAL_PRECISIONS:
            raise UsageError(f"--retrieval-precision must be one of {', '.join(RETRIEVAL_PRECISIONS)}, "
                             f"got {self.precision!r}")
        if not 0 <= self.rescore <= MAX_RESCORE:
            raise UsageError(f"--rescore must be in 0..{MAX_RESCORE}, got {self.rescore}")
        if self.embeddings not in EMBEDDING_PLACEMENTS:
            raise UsageError(f"--embeddings must be one of {', '.join(EMBEDDING_PLACEMENTS)}, got {self.embeddings!r}")

    def flags(self) -> list[str]:
        """The same settings as ``recpipe serve`` flags, for the stage processes ``--stage all`` starts."""
        return ["--cuda-graphs" if self.cuda_graphs else "--no-cuda-graphs", "--retrieval-precision", self.precision,
                "--rescore", str(self.rescore), "--embeddings", self.embeddings, *(["--nvtx"] if self.nvtx else [])]

    def check_machine(self, device: str) -> None:
        """``UsageError`` for a CUDA-only choice on a machine or ``--device`` without CUDA (never ignored)."""
        if not (self.nvtx or self.embeddings == "host"):
            return
        import torch

        cuda = torch.cuda.is_available() and not device.strip().lower().startswith("cpu")
        if self.nvtx and not torch.cuda.is_available():
            raise UsageError("--nvtx needs CUDA (NVTX ranges are for Nsight Systems on a GPU machine); "
                             "no CUDA device is available here")
        if self.embeddings == "host" and not cuda:
            raise UsageError(f"--embeddings host needs a CUDA device (tables in pinned host memory read by the GPU); "
                             f"{'--device ' + device if torch.cuda.is_available() else 'no CUDA device is available here'}")


@dataclass(frozen=True)
class StageConfig:
    """Everything one stage process needs.

    ``port`` 0 picks a free port; ``metrics_port`` None disables /metrics, 0 picks a free port.
    ``threads`` 0 leaves the libraries' defaults; ``workers`` 0 runs unbatched core calls on the event
    loop, N > 0 on a pool of N threads (batched calls always run on the batcher's own thread).
    ``batch`` sets the dynamic batcher of the batched methods; ``max_in_flight`` (gateway) bounds the
    Recommend calls in progress. ``targets`` (gateway only) maps features/retrieval/ranking to targets.
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
    batch: BatchConfig = field(default_factory=BatchConfig)
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    gpu: GpuConfig = field(default_factory=GpuConfig)
    #: ``--ranking-precision`` (choices and meaning: ``recpipe.ranking.precision``)
    ranking_precision: str = "fp32"

    def __post_init__(self) -> None:
        from recpipe.ranking.precision import check as check_ranking_precision

        check_ranking_precision(self.ranking_precision)
        if self.stage not in STAGE_NAMES:
            raise UsageError(f"unknown stage {self.stage!r}: choose {', '.join(STAGE_NAMES)} or all")
        for name, value in (("port", self.port), ("metrics-port", self.metrics_port or 0)):
            if not 0 <= value <= 65535:
                raise UsageError(f"--{name} must be in 0..65535, got {value}")
        if self.threads < 0 or self.workers < 0:
            raise UsageError("--threads and --workers must be >= 0")
        if self.grace_s < 0:
            raise UsageError("--grace must be >= 0")
        check_max_in_flight(self.max_in_flight)
        if self.stage == "gateway":
            missing = [s for s in ("features", "retrieval", "ranking") if not self.targets.get(s)]
            if missing:
                raise UsageError(f"gateway needs targets for {', '.join(missing)}")


def default_targets(host: str) -> dict[str, str]:
    """Where the gateway finds the stages when started alone with the default ports."""
    return {s: f"{host}:{DEFAULT_PORTS[s]}" for s in ("features", "retrieval", "ranking")}
