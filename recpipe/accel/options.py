"""Options shared by the stages that run a torch model (retrieval, ranking), declared once."""

from __future__ import annotations

from dataclasses import dataclass

from recpipe.serving.options import StageOptions, option


@dataclass(frozen=True)
class CudaGraphOptions(StageOptions):
    """``--cuda-graphs/--no-cuda-graphs``: one flag for every torch stage."""

    group = "GPU fast path (retrieval, ranking on a CUDA device)"

    cuda_graphs: bool = option(True, help="replay a CUDA graph per bucketed batch shape (ranking forward, user "
                                          "tower; default on; no effect on the CPU)")
