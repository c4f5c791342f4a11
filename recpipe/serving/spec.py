"""What a stage declares about itself (``StageSpec``) and the registry the serving machinery reads.

Every stage package exports one spec (``recpipe/<stage>/spec.py``): its name, its port after the
gateway's, its options dataclass, its batching defaults, the compute libraries whose threads it sizes
(and which of them a given configuration loads), the stages it calls, and how it is built.
``recpipe.stages`` lists the specs in one ``Registry``; the supervisor's launch, ``recpipe serve``, the
in-process chain, the benches and the tables take names and options from it. This module is generic: it never spells a stage's name.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from recpipe.errors import UsageError
from recpipe.serving import nvtx
from recpipe.serving import threads as thread_settings
from recpipe.serving.batcher import BatchConfig
from recpipe.serving.config import StageConfig
from recpipe.serving.options import StageOptions
from recpipe.serving.stage import Stage

#: The niceness of a stage that computes: under saturation the CPU goes to the entry stage first (its
#: weight is about 3x a nice-5 stage's), so admission and refusals stay prompt.
COMPUTE_NICE = 5
#: Cores one saturated stage process keeps busy: its event loop holds the GIL, and gRPC's own threads
#: run beside it (on the H200 machine the gateway's 2.56 ms of CPU per query at 736 q/s is 1.9 cores).
#: ``--replicas auto`` runs at most one process per this many cores.
CORES_PER_PROCESS = 2
#: ``CORES_PER_PROCESS`` where the model stages compute on a GPU: their CPU then goes to serving alone, and
#: a process at the chain's peak keeps about one core busy (78cf8d1 on the H200 machine: 12.3 cores at
#: 3,209 q/s over 11 processes and the generator). 11 processes on 16 cores gave 1.6x the rate at
#: p99 <= 20 ms of 8 in the same lease (BENCHMARKS.md, "H200 machine").
GPU_CORES_PER_PROCESS = 1.4


def cores_per_process(gpu: bool) -> float:
    """The cores ``--replicas auto`` gives each serving process, with or without a GPU."""
    return GPU_CORES_PER_PROCESS if gpu else CORES_PER_PROCESS


@dataclass(frozen=True)
class StageSpec:
    """One stage as the serving machinery sees it.

    ``port_offset``: its default gRPC port is the gateway's base port plus this (the entry stage has
    0). ``threads``: the compute libraries ``--threads`` sizes for it ("torch", "faiss", "polars"),
    before ``build`` imports them; ``loads(cfg)``: those of them a stage built from ``cfg`` imports
    (default: all), so that sizing a library never imports one the stage would not use; ``cost``: its
    CPU time per query relative to the other stages (measured, BENCHMARKS.md), by which ``--threads
    auto`` shares the cores among the stages that compute and ``--replicas auto`` the processes among
    all stages; ``nice``: the CPU scheduling niceness its own process takes (``recpipe serve --stage NAME``) (a compute stage yields the CPU to the entry stage, whose
    refusals must stay immediate when the machine is saturated). ``upstream``: the stages it calls, each reached through a target
    (``--NAME`` flag, ``$RECPIPE_NAME_TARGET``). ``build(cfg)`` makes the ``Stage`` from a
    ``StageConfig`` whose ``options`` is an instance of ``options``; it imports the stage's heavy
    modules, so it runs only once the thread settings are applied.
    """

    name: str
    port_offset: int
    build: Callable[[StageConfig], Stage]
    options: type[StageOptions] = StageOptions
    batching: BatchConfig = field(default_factory=BatchConfig)
    threads: tuple[str, ...] = ()
    loads: Callable[[StageConfig], tuple[str, ...]] | None = None
    cost: float = 0.0
    #: ``cost`` when the stage computes on a GPU (None: the same): its CPU then goes to serving alone
    gpu_cost: float | None = None
    nice: int = 0
    #: whether its processes get cores of their own under ``--affinity auto`` (``recpipe.serving.affinity``):
    #: a stage that computes a batch at a time, slowed most by sharing its core
    own_cores: bool = False
    upstream: tuple[str, ...] = ()
    #: whether it reads the model repository (``--models``, trained on ``--data``): ``recpipe serve``
    #: checks that repository before any stage starts when one of its stages does
    reads_models: bool = False
    description: str = ""

    def libraries(self, cfg: StageConfig) -> tuple[str, ...]:
        """The compute libraries among ``threads`` that the stage built from ``cfg`` loads."""
        if self.loads is None:
            return self.threads
        loaded = self.loads(cfg)
        return tuple(lib for lib in self.threads if lib in loaded)


class Registry:
    """The stages that exist, in the order their processes start (upstream before the stages calling them)."""

    def __init__(self, specs: Iterable[StageSpec]) -> None:
        self._specs = {s.name: s for s in specs}
        for s in self._specs.values():
            missing = [u for u in s.upstream if u not in self._specs]
            if missing:
                raise ValueError(f"stage {s.name!r} calls unregistered stage(s) {missing}")
        offsets = [s.port_offset for s in self._specs.values()]
        if len(set(offsets)) != len(offsets):
            raise ValueError(f"two stages share a port offset: {offsets}")

    def __iter__(self) -> Iterator[StageSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def get(self, name: str) -> StageSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UsageError(f"unknown stage {name!r}: choose {', '.join(self._specs)}") from None

    @property
    def reads_models(self) -> bool:
        """Whether any stage reads the model repository (``StageSpec.reads_models``)."""
        return any(s.reads_models for s in self)

    @property
    def entry(self) -> StageSpec:
        """The stage clients call (port offset 0: the gateway in recpipe's chain)."""
        return min(self._specs.values(), key=lambda s: s.port_offset)

    def default_ports(self, base: int) -> dict[str, int]:
        return {s.name: base + s.port_offset for s in self}

    def auto_threads(self, cores: int, replicas: Mapping[str, int] | None = None) -> dict[str, int]:
        """``--threads auto`` for the stages sharing a machine of ``cores`` cores: each stage that computes
        gets a share of the cores in proportion to its ``cost``, split among its ``replicas`` (processes;
        default one), at least one thread per process; the others none."""
        computing = [s for s in self if s.threads and s.cost > 0]
        total = sum(s.cost for s in computing)
        n = replicas or {}
        return {s.name: max(1, round(cores * s.cost / total / n.get(s.name, 1))) if s in computing else 0
                for s in self}

    def auto_replicas(self, cores: int, most: int, gpu: bool = False) -> dict[str, int]:
        """``--replicas auto`` on ``cores`` cores: one process per stage, then, while the processes number
        fewer than ``cores / cores_per_process(gpu)``, one more for the stage with the most CPU per query per
        process (its cost, ``gpu_cost`` where ``gpu``, over its processes), at most ``most`` each. With
        fewer cores than that takes, every stage keeps one: the processes already share all the cores,
        and one more adds memory and context switches, no CPU."""

        def cost(s: StageSpec) -> float:
            return s.gpu_cost if gpu and s.gpu_cost is not None else s.cost

        counts = {s.name: 1 for s in self}
        processes = int(cores / cores_per_process(gpu) + 1e-9)  # 7 / 1.4 is 5, not 4.999...
        while sum(counts.values()) < processes:
            growing = [s for s in self if cost(s) > 0 and counts[s.name] < most]
            if not growing:
                break
            busiest = max(growing, key=lambda s: cost(s) / counts[s.name])
            counts[busiest.name] += 1
        return counts

    def add_option_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Every stage's own flags (each shared flag once)."""
        seen: dict[str, Any] = {}
        for spec in self:
            spec.options.add_arguments(parser, seen)

    def options(self, args: argparse.Namespace) -> dict[str, StageOptions]:
        """Each stage's options from parsed flags (validated: ``UsageError`` on a bad value)."""
        return {spec.name: spec.options.from_namespace(args) for spec in self}

    def config(self, name: str, **settings: Any) -> StageConfig:
        """A ``StageConfig`` for stage ``name`` with ``settings`` and, unless given, its default options."""
        settings.setdefault("options", self.get(name).options())
        return StageConfig(name, **settings)

    def build(self, cfg: StageConfig) -> Stage:
        """The stage ``cfg`` names, with its thread settings applied before its libraries are imported."""
        spec = self.get(cfg.stage)
        if not isinstance(cfg.options, spec.options):
            raise TypeError(f"{spec.name}: options must be {spec.options.__name__}, got {type(cfg.options).__name__}")
        missing = [u for u in spec.upstream if not cfg.targets.get(u)]
        if missing:
            raise UsageError(f"{spec.name} needs targets for {', '.join(missing)}")
        if cfg.nvtx:
            nvtx.enable()
        libraries = spec.libraries(cfg)
        if libraries:
            thread_settings.configure(cfg.threads, torch="torch" in libraries, faiss="faiss" in libraries)
        if "torch" in libraries:
            # Decoded tensors are read-only views over the request bytes; the cores only read them, so
            # torch's warning about wrapping a non-writable array (once, at the first request) is noise.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return spec.build(cfg)
