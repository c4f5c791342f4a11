"""Compute-thread settings for torch, FAISS (OpenMP) and Polars, from ``--threads``.

Polars sizes its pool once, when it is first imported, from ``POLARS_MAX_THREADS``; OpenMP reads
``OMP_NUM_THREADS`` at start-up. So ``configure`` must run before a stage imports its core. It imports
torch and FAISS to size them: a stage asks only for the libraries it will load (``StageSpec.libraries``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

#: OpenMP's wait policy for a serving process: workers sleep between parallel regions
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity mask), else all the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many cores this process may run on (``usable_cpus``)."""
    return len(usable_cpus())


def configure(threads: int, *, torch: bool = False, faiss: bool = False) -> None:
    """Use ``threads`` compute threads (0 = leave the libraries' defaults), whose OpenMP workers sleep
    between calls (``OMP_WAIT_POLICY=PASSIVE`` unless the user set a policy): spinning workers made a
    retrieval stage with 3 threads burn 11.4 ms of CPU per query for 0.74 ms of compute on a 16-core
    box. Only a process that has not loaded OpenMP yet is affected (a stage process, before its core)."""
    if "torch" not in sys.modules and "faiss" not in sys.modules:
        os.environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")
    if threads <= 0:
        return
    for var in ("POLARS_MAX_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    if torch:
        import torch as _torch

        _torch.set_num_threads(threads)
    if faiss:
        import faiss as _faiss

        _faiss.omp_set_num_threads(threads)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on ``n`` torch threads, then restore the count it had, and FAISS's where FAISS is
    loaded: where the two load one OpenMP runtime (the pip wheels here do), torch's count is FAISS's
    too. For code that commands run in-process (a training, a characterization's probes): the caller's
    process keeps its own settings."""
    import torch

    faiss = sys.modules.get("faiss")
    previous = torch.get_num_threads()
    previous_faiss = faiss.omp_get_max_threads() if faiss is not None else 0
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
        if faiss is not None:
            faiss.omp_set_num_threads(previous_faiss)


def in_use(library: str) -> int:
    """Compute threads ``library`` ("torch", "faiss" or "polars") uses in this process (0 if it is not loaded)."""
    module = sys.modules.get(library)
    if module is None:
        return 0
    if library == "faiss":
        return int(module.omp_get_max_threads())
    return int(module.get_num_threads() if library == "torch" else module.thread_pool_size())
