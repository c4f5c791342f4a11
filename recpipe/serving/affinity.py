"""Which CPUs each stage process runs on: ``--affinity auto|off`` for the chain, ``--cpus LIST`` for one
stage process (what the supervisor passes it).

Where the chain's processes outnumber the cores, the kernel time-slices a stage's compute with the
other processes and moves it between cores. A batch's ranking forward is a few milliseconds of one
thread through a compiled graph and oneDNN kernels, and in the chain it ran about twice as slow per
query as warm and alone (2-core VM: 1.2-1.3 ms per query in batches of 3-11 at 300 q/s against 0.47 in
``recpipe bench ranking``), presumably from the sharing (not isolated). A stage like that, which takes
most of the chain's CPU (``StageSpec.own_cores``: ranking), gets cores of its own; the other stages
that compute share the rest, and the entry stage runs anywhere (below).

On the 2-core VM (AVX512-BF16, scale 0.1, serve defaults; ``querygen --mode open --rate 400
--slo-p99-ms 50 --duration 8``, 5 alternating rounds) the highest rate at p99 <= 50 ms was 193.75-400
q/s (median 375) with ranking alone on one core and the other stages, the gateway too, on the other, against 193.75-350
(median 300) unpinned and 150-250 (median 193.75) for 03a97ac. Ranking and retrieval on one core, the
gateway and features on the other, gave 243.75 / 275 (2 rounds): ranking loses what it shares. That
form's price was at saturation, where the others' one core is the limit: a closed loop of 8 clients got 2.59-2.82
ms of CPU per query and 407-436 q/s against 2.45-2.62 and 418-449 unpinned (3 rounds; BENCHMARKS.md).

The entry stage (the gateway) is never confined: it is the chain's door, and it must keep up admitting
and refusing however loaded the stages are. Confined with features and retrieval to the one core left
beside ranking, at 3x the SLO rate (``querygen --mode open --rate 1200 --duration 10``) it refused
nothing, and its calls took 2.4 s at p50 until the generator cancelled them; running anywhere it
refused 52% at once with RESOURCE_EXHAUSTED, as unpinned (47%). That costs some of the gain above: with
the gateway free, 337.5 / 325 / 337.5 q/s against 450 / 387.5 / 387.5 confined (3 alternating rounds),
and on another day 325 / 375 / 412.5 against 03a97ac's 168.75 / 218.75 / 243.75. Free, it has no measurable
price at saturation: closed loop 8, 2.54-2.75 ms of CPU per query against 2.43-2.79 unpinned (3 rounds).

``auto`` pins only where the processes outnumber the usable cores (where each process can have a core
the sharing above need not happen, and pinning there is not measured) and where the own-core stages'
processes (one core per compute thread each) leave the others at least one core; elsewhere it leaves
placement to the kernel.
Containers (compose, Kubernetes) run one stage each: their placement is the runtime's (``cpuset``,
the kubelet's static CPU manager), not this.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from recpipe.errors import UsageError
from recpipe.serving.threads import usable_cpus

if TYPE_CHECKING:
    from recpipe.serving.spec import Registry

#: ``--affinity``'s choices, shared by every command that starts the chain and ``characterize``'s settings
AFFINITIES = ("auto", "off")
#: ``--affinity`` help, shared by every command that starts the chain.
AFFINITY_HELP = ("where the stage processes run: auto (default) gives ranking cores of its own and the other "
                 "stages the rest where the processes outnumber the cores; off leaves placement to the kernel")

#: One CPU set per process of each stage: ``plan``'s answer (a stage it leaves out runs anywhere)
Placement = dict[str, list[tuple[int, ...]]]


def affinity_arg(text: str) -> str:
    """``--affinity``: auto or off."""
    if text not in AFFINITIES:
        raise argparse.ArgumentTypeError(f"must be {' or '.join(AFFINITIES)}, got {text!r}")
    return text


def parse_cpus(text: str) -> tuple[int, ...]:
    """A CPU list as the kernel writes one ("0-2,5") -> (0, 1, 2, 5)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, dash, last = part.partition("-")
            lo, hi = int(first), int(last if dash else first)
            if lo < 0 or hi < lo:
                raise ValueError
            cpus.update(range(lo, hi + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a CPU list such as 1 or 0-3,6, got {text!r}") from None
    return tuple(sorted(cpus))


def format_cpus(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


#: the CPUs this process could run on before ``pin`` narrowed them: the chain's (None: not pinned)
_before_pin: tuple[int, ...] | None = None


def chain_cores() -> int:
    """The cores the chain's processes share: this process's own before ``--cpus`` placed it (what a
    decision weighing the chain's processes against the cores needs, not the process's own share)."""
    return len(_before_pin or usable_cpus())


def pin(cpus: Sequence[int]) -> None:
    """Run this process, and every thread it starts from now on, on ``cpus`` (``--cpus``): a stage process
    calls it first, before it loads a library that starts threads."""
    global _before_pin
    allowed = usable_cpus()
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise UsageError(f"--cpus {format_cpus(cpus)}: this process may only run on CPUs {format_cpus(allowed)}")
    if not hasattr(os, "sched_setaffinity"):
        raise UsageError("--cpus: this platform cannot pin a process to CPUs")
    _before_pin = _before_pin or allowed
    tasks = "/proc/self/task"  # every thread already started too, not only the caller
    for tid in (os.listdir(tasks) if os.path.isdir(tasks) else ["0"]):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def plan(registry: Registry, flag: str, replicas: Mapping[str, int], threads: int | Mapping[str, int],
         cores: Sequence[int] | None = None) -> tuple[Placement, str]:
    """The CPUs of every stage process under ``--affinity flag`` on ``cores`` (default: the usable
    ones), given the processes per stage (``replicas``) and their compute threads, and a line saying
    what was chosen. Each process of an own-core stage gets as many cores as it has threads (at least
    one), taken from the top; every other process but the entry stage's gets the cores left."""
    cores = sorted(usable_cpus() if cores is None else cores)
    n = len(cores)
    if flag == "off":
        return {}, "affinity: off (every stage process may run on any core)"

    def width(name: str) -> int:
        return max(1, threads if isinstance(threads, int) else threads.get(name, 1))

    processes = sum(replicas.get(s.name, 1) for s in registry)
    own = [s for s in registry if s.own_cores]
    need = sum(replicas.get(s.name, 1) * width(s.name) for s in own)
    why = ""
    if not own:
        why = "no stage asks for cores of its own"
    elif not hasattr(os, "sched_setaffinity"):
        why = "this platform cannot pin a process"
    elif processes <= n:
        why = f"{processes} processes on {n} cores: each can have a core"
    elif need > n - 1:
        why = f"{'/'.join(s.name for s in own)} would take {need} of {n} cores, leaving the other stages none"
    if why:
        return {}, f"affinity: auto on {n} core{'s' * (n != 1)}: every process anywhere ({why})"
    placement: Placement = {}
    top = n
    for s in own:
        placement[s.name] = []
        for _ in range(replicas.get(s.name, 1)):
            w = width(s.name)
            placement[s.name].append(tuple(cores[top - w:top]))
            top -= w
    rest = tuple(cores[:top])
    for s in registry:
        if s.name not in placement and s is not registry.entry:  # the door runs anywhere (module doc)
            placement[s.name] = [rest] * replicas.get(s.name, 1)
    mine_names = {s.name for s in own}
    mine = "; ".join(f"{name} on CPU {' / '.join(format_cpus(c) for c in sets)}"
                     for name, sets in placement.items() if name in mine_names)
    others = ", ".join(s.name for s in registry if s.name not in mine_names and s is not registry.entry)
    return placement, (f"affinity: auto on {n} cores, {processes} processes: {mine}; {others} on CPU "
                       f"{format_cpus(rest)}; {registry.entry.name} on any (--affinity off leaves placement to the kernel)")
