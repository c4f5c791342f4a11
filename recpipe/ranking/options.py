"""The ranking stage's own settings, declared once: each a ``recpipe serve`` flag with its default,
help and check (``recpipe.serving.options``)."""

from __future__ import annotations

from dataclasses import dataclass

from recpipe.accel.options import CudaGraphOptions
from recpipe.errors import UsageError
from recpipe.ranking import precision as precisions
from recpipe.serving.options import option

#: Where the DLRM tables live on a CUDA device: device memory, or pinned host memory read in place.
EMBEDDING_PLACEMENTS: tuple[str, ...] = ("device", "host")


@dataclass(frozen=True)
class RankingOptions(CudaGraphOptions):
    """Ranking: ``precision`` of the forward on the CPU (``recpipe.ranking.precision``), and on the GPU
    fast path ``embeddings`` in device memory or in pinned host memory."""

    group = "ranking"

    precision: str = option(precisions.SERVE_DEFAULT, flag="--ranking-precision", choices=precisions.PRECISIONS,
                            help="ranking forward on the CPU in fp32, bf16 (CPUs with native bf16) or int8 (dynamic "
                                 "quantization); auto (default): the fastest here within "
                                 f"{precisions.AUC_BUDGET:g} held-out AUC of fp32, as measured by recpipe train; a "
                                 "CUDA device runs fp32")
    embeddings: str = option("device", choices=EMBEDDING_PLACEMENTS,
                             help="DLRM tables in device memory, or in pinned host memory read by the GPU in place "
                                  "(host: CUDA only)")

    def __post_init__(self) -> None:
        precisions.check(self.precision)
        if self.embeddings not in EMBEDDING_PLACEMENTS:
            raise UsageError(f"--embeddings must be one of {', '.join(EMBEDDING_PLACEMENTS)}, got {self.embeddings!r}")

    def check_machine(self, device: str) -> None:
        if self.embeddings != "host":
            return
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--embeddings host needs a CUDA device (tables in pinned host memory read by the GPU); "
                             "no CUDA device is available here")
        if device.strip().lower().startswith("cpu"):
            raise UsageError(f"--embeddings host needs a CUDA device (tables in pinned host memory read by the GPU); "
                             f"--device {device}")
