"""The training allocator setting: large freed blocks stay in the heap inside ``kept_heap`` only."""

from __future__ import annotations

import ctypes.util
import platform
import resource

import pytest
import torch

from recpipe.training import heap

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _faults(rounds: int, rows: int) -> int:
    """Minor page faults taken by allocating, filling and freeing a (rows, 4096) float tensor ``rounds`` times."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        block = torch.ones(rows, 4096)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_large_blocks_are_reused_inside_and_mapped_afresh_outside() -> None:
    rounds = 8
    outside = _faults(rounds, 4096)  # 64 MiB: above glibc's largest mmap threshold
    with heap.kept_heap() as applied:
        assert applied
        _faults(16, 4096)  # the heap grows to its working size first (a few blocks)
        inside = _faults(rounds, 4096)
    # a block larger than what the heap kept is mapped afresh again once the block is left
    after = _faults(rounds, 8192)
    assert inside * 10 < outside
    assert after > outside


def test_disabled_changes_nothing() -> None:
    with heap.kept_heap(enabled=False) as applied:
        assert not applied


def test_a_libc_without_mallopt_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    with heap.kept_heap() as applied:
        assert not applied
