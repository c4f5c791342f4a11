"""NVTX ranges: a null context when off, an error without CUDA, paired start/end through the batcher,
and enabling them on a GPU (``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from fast_path_support import CUDA, no_cuda_only

from recpipe.errors import UsageError
from recpipe.serving import nvtx


def test_nvtx_ranges_are_a_shared_null_context_when_off() -> None:
    assert not nvtx.enabled()
    assert nvtx.range("rank.compute") is nvtx.range("rank.queue")
    with nvtx.range("rank.compute"):
        pass
    assert nvtx.start("rank.queue") is None
    nvtx.end(None)
    assert nvtx.step_prefix("ranking.Rank") == "rank"
    assert nvtx.step_prefix("features.AugmentItems") == "augment_items"
    assert nvtx.step_prefix("retrieval.Retrieve") == "retrieve"


@no_cuda_only
def test_nvtx_without_cuda_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--nvtx needs CUDA"):
        nvtx.enable()
    assert not nvtx.enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_nvtx_enable_on_cuda() -> None:
    try:
        nvtx.enable()
        with nvtx.range("rank.compute"):
            handle = nvtx.start("rank.queue")
        nvtx.end(handle)
    finally:
        nvtx.disable()


def test_batcher_ranges_open_and_close_in_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVTX calls themselves recorded on the CPU (torch's range_start/range_end stubbed)."""
    import asyncio

    from recpipe.serving.batcher import BatchConfig, Batcher

    opened: dict[int, str] = {}
    closed: list[int] = []

    def range_start(name: str) -> int:
        opened[len(opened)] = name
        return len(opened) - 1

    monkeypatch.setattr(torch.cuda.nvtx, "range_start", range_start)
    monkeypatch.setattr(torch.cuda.nvtx, "range_end", closed.append)
    monkeypatch.setattr(nvtx, "_enabled", True)

    async def go() -> list[int]:
        batcher = Batcher("ranking.Rank", lambda qs: [q * 2 for q in qs], BatchConfig(max_batch=4))
        answers = await asyncio.gather(*(batcher.submit(i) for i in range(6)))
        with nvtx.range("rank.encode"):
            pass
        await batcher.close()
        return [a.value for a in answers]

    assert asyncio.run(go()) == [0, 2, 4, 6, 8, 10]
    assert sorted(closed) == sorted(opened) and len(closed) == len(set(closed))
    names = list(opened.values())
    assert names.count("rank.queue") == 6 and names.count("rank.compute") >= 2 and "rank.encode" in names
