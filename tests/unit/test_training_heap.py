"""The training allocator setting: large freed blocks stay in the heap inside ``kept_heap`` only."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

from recpipe.training import heap

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


#: run in a fresh interpreter: what the allocator does depends on the heap's state, and earlier tests in
#: this process (an in-process ``recpipe train`` among them) leave large free chunks that serve a big
#: block without a fault whatever the settings
_MEASURE = """
import resource, torch
from recpipe.training import heap

def faults(rounds, rows):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        block = torch.ones(rows, 4096)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

outside = faults(8, 4096)  # 64 MiB: above glibc's largest mmap threshold
with heap.kept_heap() as applied:
    assert applied
    faults(16, 4096)  # the heap grows to its working size first (a few blocks)
    inside = faults(8, 4096)
after = faults(8, 8192)  # larger than what the heap kept: mapped afresh again once the block is left
print(outside, inside, after)
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_large_blocks_are_reused_inside_and_mapped_afresh_outside() -> None:
    done = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    outside, inside, after = (int(x) for x in done.stdout.split())
    assert inside * 10 < outside
    assert after > outside


def test_disabled_changes_nothing() -> None:
    with heap.kept_heap(enabled=False) as applied:
        assert not applied


def test_a_libc_without_mallopt_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    with heap.kept_heap() as applied:
        assert not applied
