"""Keep freed memory in the process heap while training on the CPU (glibc's ``mallopt``).

A DLRM training step at batch 4096 allocates tensors of 30-63 MB (the pairwise dots, the top MLP's
input and their gradients) and frees them again. glibc serves every allocation above its mmap
threshold (32 MB at most) with a fresh ``mmap`` and unmaps it on free, so each step faults those
pages in again: a quarter of the step's time, much of it system time (BENCHMARKS.md, issue 23).
Inside ``kept_heap()`` large blocks come from the heap and stay there for the next step, as a caching
allocator would keep them. Elsewhere (and off glibc) nothing changes. Only the DLRM's training loop
uses it: phases that allocate big arrays once gain nothing, and lose the huge pages numpy asks for
on mapped blocks.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: glibc's documented defaults, restored on the way out (the mmap threshold itself is left as it is)
DEFAULT_TRIM_THRESHOLD = 128 * 1024
DEFAULT_MMAP_MAX = 65536
#: freed memory above this at the top of the heap goes back to the system even inside ``kept_heap``
KEPT_TRIM_THRESHOLD = 1 << 30


def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # no libc to load, or one without mallopt (musl's refuses: 0)
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


@contextlib.contextmanager
def kept_heap(enabled: bool = True) -> Iterator[bool]:
    """Within the block, no allocation is served by ``mmap`` and freed memory stays in the heap (up
    to 1 GiB at its top). Yields whether that took effect (glibc only). On the way out glibc's defaults
    come back, except that its mmap threshold stops adapting. Large blocks are mapped again, unless a
    free chunk the block left in the heap fits them."""
    fn = _mallopt() if enabled else None
    applied = fn is not None and bool(fn(M_MMAP_MAX, 0)) and bool(fn(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD))
    if fn is not None and not applied:
        log.debug("mallopt refused the settings; the allocator is unchanged")
    try:
        yield applied
    finally:
        if fn is not None:
            fn(M_MMAP_MAX, DEFAULT_MMAP_MAX)
            fn(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
