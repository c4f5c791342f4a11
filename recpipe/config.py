"""Cross-cutting constants and defaults shared by every stage.

Per-command configuration lives as frozen dataclasses next to the code that uses it
(e.g. ``recpipe.datagen.config``); this module holds only what several packages must agree on.
"""

from __future__ import annotations

from typing import Final

#: The four timed stages of one Recommend call, in chain order, as they appear in StageTiming.stage.
STAGES: Final[tuple[str, ...]] = ("augment_user", "retrieve", "augment_items", "rank")
#: The StageTiming.stage name of the whole call as seen by the gateway.
TOTAL_STAGE: Final[str] = "total"

DEFAULT_HOST: Final[str] = "127.0.0.1"
DEFAULT_PORTS: Final[dict[str, int]] = {
    "gateway": 50051,
    "features": 50052,
    "retrieval": 50053,
    "ranking": 50054,
}


def normalize_target(target: str) -> str:
    """A gRPC target as the user typed it, made explicit: a host-less ``:PORT`` means
    ``127.0.0.1:PORT`` (everything here listens on loopback by default); anything else is unchanged
    (``host:port``, ``[::1]:port``, ``dns:///name:port``, ``unix:path``)."""
    t = target.strip()
    if t.startswith(":") and t[1:].isdigit():
        return f"{DEFAULT_HOST}{t}"
    return t


DEFAULT_NUM_CANDIDATES: Final[int] = 500
DEFAULT_NUM_RESULTS: Final[int] = 10
MAX_NUM_CANDIDATES: Final[int] = 10_000

DEFAULT_DATA_DIR: Final[str] = "data"
DEFAULT_MODELS_DIR: Final[str] = "models"

#: The GPU fast path's choices (``recpipe serve``): the retrieval scan's precision (auto = fp16 on a
#: CUDA device, the FAISS index on the CPU), the fp32 re-score factor, and where the DLRM tables live.
RETRIEVAL_PRECISIONS: Final[tuple[str, ...]] = ("auto", "fp32", "fp16", "bf16")
DEFAULT_RESCORE: Final[int] = 2
MAX_RESCORE: Final[int] = 64
EMBEDDING_PLACEMENTS: Final[tuple[str, ...]] = ("device", "host")
