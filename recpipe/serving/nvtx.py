"""NVTX ranges for Nsight Systems: ``with nvtx.range("rank.compute"): ...``, free when off.

``recpipe serve --nvtx`` / ``recpipe bench ... --nvtx`` call ``enable()`` in each process; until then
``range`` returns one shared null context (a global read and a call, nothing else). Ranges are
start/end ranges (``torch.cuda.nvtx.range_start``/``range_end``), not push/pop, because the
servicers' and the batcher's spans cross ``await`` points and threads: a push/pop stack is per thread
and interleaved coroutines would pop each other's ranges.

Names: ``<stage>.<step>``, e.g. ``rank.decode``, ``rank.queue``, ``rank.compute``, ``rank.encode``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from recpipe.errors import UsageError

_NULL = contextlib.nullcontext()
_enabled = False


def enabled() -> bool:
    return _enabled


def check_available() -> None:
    """``UsageError`` (exit code 2) unless torch sees a CUDA device: the ranges need CUDA's NVTX."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--nvtx needs CUDA (NVTX ranges are for Nsight Systems on a GPU machine); "
                         "no CUDA device is available here")


def enable() -> None:
    """Turn the ranges on in this process (checked: a clear ``UsageError`` without CUDA)."""
    global _enabled
    check_available()
    _enabled = True


def disable() -> None:
    global _enabled
    _enabled = False


@contextlib.contextmanager
def _span(name: str) -> Iterator[None]:
    import torch

    handle = torch.cuda.nvtx.range_start(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_end(handle)


def range(name: str) -> contextlib.AbstractContextManager[Any]:
    """A named range around the body while enabled; the shared null context otherwise."""
    return _span(name) if _enabled else _NULL


def start(name: str) -> int | None:
    """Open a range that another place closes (``end``); None while disabled."""
    if not _enabled:
        return None
    import torch

    return int(torch.cuda.nvtx.range_start(name))


def end(handle: int | None) -> None:
    if handle is not None:
        import torch

        torch.cuda.nvtx.range_end(handle)


def step_prefix(method: str) -> str:
    """``"ranking.Rank"`` -> ``"rank"``, ``"features.AugmentItems"`` -> ``"augment_items"`` (the
    StageTiming names), so the batcher's ranges line up with the servicers'."""
    name = method.rsplit(".", 1)[-1]
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))
