"""What a measured run kept busy, and so what likely limited it: the machine's cores, one process's
Python thread, the GPU, or none of them (the time went to waiting).

A run's ``load`` (``sections._load``) holds the share of all cores that was busy (/proc/stat), the cores
each process group used (CPU seconds per second: a stage's replicas together, the generator with its
sender processes) and how many processes each group is. A serving process runs its gRPC handlers on
one event-loop thread under one GIL, so a group at about one core per process is capped there whatever
the machine has left: that is what two chains on one GPU showed (1.78x the q/s of one, issue 35).
"""

from __future__ import annotations

from typing import Any

from recpipe import cputime

#: cores per process from which a process group is named a likely limit (its one Python thread)
PROCESS_BOUND = 0.9
#: cores per process from which a group evidently ran several busy threads (compute threads beside its loop)
SEVERAL_THREADS = 1.5
#: a GPU busy at least this share of the time was the limit
GPU_BOUND = 0.9


def busiest(load: dict[str, Any]) -> tuple[str, float, int] | None:
    """The process group with the most cores per process: (name, cores per process, processes)."""
    best: tuple[str, float, int] | None = None
    for name, cores in (load.get("cores") or {}).items():
        if cores is None:
            continue
        n = max(1, int((load.get("processes") or {}).get(name, 1)))
        if best is None or cores / n > best[1]:
            best = (name, cores / n, n)
    return best


def describe(load: dict[str, Any] | None, gpu_busy: float | None = None) -> str:
    """One sentence: how busy the machine, the busiest process group and the GPU were, and which of them
    was the likely limit; ``""`` for a document from before runs recorded their load."""
    if not load:
        return ""
    share = load.get("machine_busy")
    top = busiest(load)
    parts = [f"machine {share:.0%} busy (all cores)" if share is not None else "machine load not readable"]
    if top is not None:
        name, per, n = top
        parts.append(f"busiest process: {name} at {per:.2f} cores" + (f" each ({n} processes)" if n > 1 else ""))
    if gpu_busy is not None:
        parts.append(f"GPU {gpu_busy:.0%} busy")
    if share is not None and share >= cputime.SATURATED:
        verdict = "the machine's cores were the limit"
    elif top is not None and top[1] >= SEVERAL_THREADS:
        verdict = f"{top[0]} ran several busy threads: their number was the likely limit"
    elif top is not None and top[1] >= PROCESS_BOUND:
        verdict = f"{top[0]}'s own thread was the likely limit (a Python thread holds one core at most)"
    elif gpu_busy is not None and gpu_busy >= GPU_BOUND:
        verdict = "the GPU was the limit"
    else:
        verdict = "nothing was saturated: the time went to waiting (hops, batches, the clients)"
    return "; ".join(parts) + f": {verdict}."
