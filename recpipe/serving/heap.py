"""The serving process's heap, settled once it has loaded: collected, then frozen out of the collector.

A loaded stage holds hundreds of thousands of long-lived Python objects (torch, Polars, FAISS, the
compiled forward's graphs: 488k in the ranking stage at scale 0.1). CPython's full (generation 2)
collection walks all of them: 225 ms in that process, 70-200 ms seen in the stages while they loaded,
and the event loop answers nothing meanwhile. One falls due whenever the objects that survived
collections grow by a quarter, so a long run meets them. ``gc.freeze()`` moves every object alive at
load into a permanent generation that collections skip, so a later full collection walks only what
serving allocated since; the objects frozen stay alive, as they would have anyway (the process holds
them until it exits). Instagram's web servers do the same after fork.

Then glibc's malloc keeps the memory serving frees (``keep_freed_memory``). By default it hands a
large freed block back to the kernel (a block over its mmap threshold is unmapped; free space over its
trim threshold at the top of the heap is trimmed), and the next allocation of that size faults every
page in again, zeroed. A batch call's messages are such blocks: a RankBatch of 6 x 500 candidates is
565 kB, serialized into one buffer and copied into another, so the gateway took 60.5-61.1 page faults
per query; keeping them, 3.4-3.7, and its CPU per query fell from 0.86 to 0.74 ms (means of 5 rounds,
2-core EPYC VM, closed loop, 8 clients; BENCHMARKS.md). The process keeps up to its peak of freed
memory instead of returning it (the gateway's RSS: +5 MB).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import time

log = logging.getLogger(__name__)

#: ``mallopt`` parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: blocks below this come from the heap, not from their own mapping (glibc's largest: 32 MiB on 64-bit)
MMAP_THRESHOLD = 32 << 20
#: free space at the top of the heap kept up to this much (a batch call's buffers are a few MB)
TRIM_THRESHOLD = 64 << 20


def settle(name: str) -> int:
    """Collect what loading left behind, then freeze the rest (see module doc); returns the objects
    frozen in all. Cheap when called again: only what was allocated since is collected and frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    kept = keep_freed_memory()
    log.info("%s: %d objects frozen out of the garbage collector after load (%.0f ms); freed memory %s", name,
             frozen, (time.perf_counter() - t0) * 1e3, "kept" if kept else "left to malloc's defaults")
    return frozen


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the blocks this process frees, up to the thresholds above (module doc);
    False where the C library is not glibc (musl, macOS), which is left as it is."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has a mallopt that does nothing)
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
