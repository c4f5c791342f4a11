"""The retrieval stage's own settings, declared once: each a ``recpipe serve`` flag with its default,
help and check (``recpipe.serving.options``)."""

from __future__ import annotations

from dataclasses import dataclass

from recpipe.accel.device import certainly_cpu
from recpipe.accel.options import CudaGraphOptions
from recpipe.errors import UsageError
from recpipe.serving.options import option

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

    def needs_torch(self, device: str) -> bool:
        """Whether a core with these options on ``--device device`` may import torch, decided without
        importing it: not with the FAISS index on a device that is certainly the CPU, where the user
        tower runs folded into numpy (``RetrievalCore``)."""
        return not (certainly_cpu(device) and self.precision in ("auto", "fp32"))
