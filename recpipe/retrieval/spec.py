"""The retrieval stage as the serving machinery sees it: name, port, options, thread libraries, builder."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from recpipe.accel.options import CudaGraphOptions
from recpipe.errors import UsageError
from recpipe.serving.config import StageConfig
from recpipe.serving.options import option
from recpipe.serving.spec import COMPUTE_NICE, StageSpec
from recpipe.serving.stage import Stage

#: The exact scan's precision (auto = fp16 on a CUDA device, the FAISS index on the CPU).
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "fp16", "bf16")
DEFAULT_RESCORE = 2
MAX_RESCORE = 64


@dataclass(frozen=True)
class RetrievalOptions(CudaGraphOptions):
    """The GPU fast path of retrieval: ``precision`` of the exact scan on the device, and ``rescore``:
    the half-precision scan keeps rescore x k candidates and re-scores them in fp32 (0 = off)."""

    group = "retrieval"

    precision: str = option("auto", flag="--retrieval-precision", choices=PRECISIONS,
                            help="exact retrieval scan in fp16/bf16 on the device (auto: fp16 on CUDA, the FAISS "
                                 "index on the CPU; fp32: FAISS / fp32 exact)")
    rescore: int = option(DEFAULT_RESCORE, help=f"half-precision retrieval keeps N x k candidates and re-scores "
                                                f"them in fp32 (0 = off, max {MAX_RESCORE}; default {DEFAULT_RESCORE})")

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UsageError(f"--retrieval-precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 0 <= self.rescore <= MAX_RESCORE:
            raise UsageError(f"--rescore must be in 0..{MAX_RESCORE}, got {self.rescore}")


def build(cfg: StageConfig) -> Stage:
    from recpipe.retrieval.core import RetrievalCore
    from recpipe.retrieval.servicer import RetrievalStage

    opts = cfg.options
    assert isinstance(opts, RetrievalOptions)
    return RetrievalStage.over(lambda: RetrievalCore.load(cfg.models_dir, device=cfg.device, **asdict(opts)), cfg)


SPEC = StageSpec("retrieval", port_offset=2, build=build, cost=1.7, nice=COMPUTE_NICE, options=RetrievalOptions, threads=("torch", "faiss"),
                 description="user tower -> query embedding -> FAISS / exact top-k")
