"""Cross-cutting constants and defaults shared by every stage.

Per-command configuration lives as frozen dataclasses next to the code that uses it
(e.g. ``recpipe.datagen.config``); this module holds only what several packages must agree on.
"""

from __future__ import annotations

from typing import Final

#: The four timed steps of one Recommend call, in chain order: their wire names in StageTiming.stage, the
#: JSON of querygen runs and the tables. (A *step* is part of a query; a *stage* is a process, named by
#: its spec in ``recpipe.stages``; ``recpipe.gateway.spec.STEP_STAGES`` says which stage runs each step.)
STEPS: Final[tuple[str, ...]] = ("augment_user", "retrieve", "augment_items", "rank")
#: The StageTiming.stage name of the whole call as seen by the gateway.
TOTAL_STEP: Final[str] = "total"

DEFAULT_HOST: Final[str] = "127.0.0.1"
#: The gateway's gRPC port (the chain's entry); every other stage listens at this plus its spec's
#: ``port_offset`` (``recpipe/<stage>/spec.py``).
DEFAULT_PORT: Final[int] = 50051


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

#: A batch or stream message's entries at most (``<Method>Batch``, ``<Method>Stream``): a stage refuses a
#: message with more whole, with INVALID_ARGUMENT, before any per-entry work (90,000 cheap entries held
#: a stage's event loop past its supervisor's patience); the gateway's ``--hop-max-batch`` is at most this.
MAX_BATCH_ENTRIES: Final[int] = 256
#: A batch or stream message's rows at most, summed over its entries (a Rank entry's candidates, an
#: AugmentItems entry's item ids, 1 for AugmentUser and Retrieve, whose answers are 12 bytes a
#: candidate): a stage refuses a message with more, and the gateway cuts its batches there. It keeps the
#: largest messages (Rank's requests and AugmentItems' answers, 192 bytes a row) under a third of the
#: 64 MiB limit: at ``--hop-max-batch 64`` and the contract's 10,000 candidates a query, a Rank message
#: would be 123 MB (at the default 32, 61 MB: 92% of the limit).
MAX_BATCH_ROWS: Final[int] = 100_000

#: A stream's messages a stage answers at once at most (``<Method>Stream``): it reads the next only once one
#: of them is written, so a caller that sends without reading its answers is held back by HTTP/2's flow
#: control instead of the stage computing and buffering every message it sends (one such caller grew a
#: feature stage by 4 GB in 40 s). The gateway keeps ``--hop-max-in-flight`` messages out per stream
#: (default one per replica); one more than this waits to be read, its entries' deadlines running.
MAX_STREAM_MESSAGES: Final[int] = 32

DEFAULT_DATA_DIR: Final[str] = "data"
DEFAULT_MODELS_DIR: Final[str] = "models"
