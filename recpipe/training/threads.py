"""Torch's threads for a training run, and how its OpenMP workers wait between parallel regions.

Torch's CPU build runs its intra-op threads (and MKL's) on GNU OpenMP, whose workers spin after each
parallel region before they sleep. On a 2-core machine that is shared, a spinning worker takes the
core the other process needs, and the next region waits for it. A full-scale DLRM step with two
threads ran 1.8x slower than with one beside a busy process, and 1.6-1.7x faster on an idle machine.
With sleeping workers (``OMP_WAIT_POLICY=PASSIVE``) two threads kept the idle gain (1.62x), and beside
the busy process ran at 0.94x of one thread (BENCHMARKS.md, "Training threads").

OpenMP reads ``OMP_WAIT_POLICY`` once, when the library loads, so ``recpipe train`` imports torch and
faiss (which carries its own OpenMP) under it (``import_with_sleeping_workers``), unless the user
chose a policy. The variable is put back afterwards: processes started later (a demo's stages, whose
latency is measured) inherit the user's environment, not the trainer's.
"""

from __future__ import annotations

import os
import sys

from recpipe.serving.threads import WAIT_POLICY_ENV

_imported_with: list[str] = []  # the policy torch was imported under, when it was imported here


def import_with_sleeping_workers() -> None:
    """Import torch and faiss with ``OMP_WAIT_POLICY=PASSIVE`` unless the user set the variable; the
    environment is restored afterwards. Once torch is loaded this does nothing: its workers already
    wait the way the process started them."""
    if "torch" in sys.modules:
        return
    own = os.environ.get(WAIT_POLICY_ENV)
    os.environ[WAIT_POLICY_ENV] = "PASSIVE" if own is None else own
    try:
        import faiss  # noqa: F401  (its own OpenMP runtime reads the variable as it loads)
        import torch  # noqa: F401

        _imported_with.append(os.environ[WAIT_POLICY_ENV])
    finally:
        if own is None:
            os.environ.pop(WAIT_POLICY_ENV, None)


def wait_policy() -> str | None:
    """The ``OMP_WAIT_POLICY`` torch's workers run under: the one they were imported with here, else
    the process's environment (None: OpenMP's default, spin a while and then sleep)."""
    return _imported_with[0] if _imported_with else os.environ.get(WAIT_POLICY_ENV)


def training_threads(requested: int) -> int:
    """``requested``, or for 0: torch's default (a thread per core), except 1 on machines with 2 cores
    or fewer where the workers spin (a wait policy other than PASSIVE): there two spinning threads
    beside any other busy process ran 1.8-2.5x slower than one."""
    import torch

    if requested > 0:
        return requested
    if (os.cpu_count() or 1) <= 2 and (wait_policy() or "").strip().upper() != "PASSIVE":
        return 1
    return torch.get_num_threads()
