"""CUDA graphs per bucketed input shape, and the same bucketing run eagerly on the CPU (its twin).

A small forward on the GPU is launch-bound: tens of small kernels, each costing more to launch than to
run. A captured CUDA graph replays all of them with one launch. A graph has fixed shapes, so the
callers pad their inputs up to a *bucket* (``bucket(n)``: the next power of two, at least a floor) and
slice the answer back; one graph is captured per bucketed shape, the first time it is seen, into one
memory pool shared by all of them (the replays never overlap: one compute thread per stage).

Modes of a ``GraphRunner``:

- ``graph``: CUDA only; copy the inputs into the graph's static buffers, replay, return its static
  output (valid until the next call: consume it first);
- ``padded``: the same padded inputs run eagerly (on the CPU: what the tests check against the
  unpadded answer; on CUDA: ``--no-cuda-graphs`` keeps shapes, not launches, fixed);
- ``eager``: no padding at all (the default on the CPU, where padding would only add work).

Example::

    runner = GraphRunner(lambda x: torch.relu(x) * 2, torch.device("cpu"), "padded")
    x = torch.zeros(bucket(5), 3)           # (8, 3): 5 real rows, 3 rows of padding
    runner(x)[:5]                            # the 5 real answers
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from recpipe.accel.device import kind

if TYPE_CHECKING:  # torch is imported where a runner captures: bucket and mode_for are light
    import torch

_log = logging.getLogger(__name__)
GRAPH_MODES = ("graph", "padded", "eager")
#: Graphs captured per runner at most; shapes beyond that run eagerly (still padded).
MAX_GRAPHS = 64
#: Rows above this are never captured (their graph's memory would outweigh one launch saved).
MAX_GRAPH_ROWS = 1 << 17


def bucket(n: int, smallest: int = 1) -> int:
    """The next power of two >= max(n, smallest): bucket(500) == 512, bucket(3, 16) == 16."""
    n = max(int(n), int(smallest), 1)
    return 1 << (n - 1).bit_length()


def mode_for(device: torch.device | str, cuda_graphs: bool) -> str:
    """``graph`` on a CUDA device with graphs on, ``padded`` on CUDA with them off, else ``eager``."""
    if kind(device) == "cuda":
        return "graph" if cuda_graphs else "padded"
    return "eager"


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: Any  # a tensor or a tuple of tensors


class GraphRunner:
    """``fn(*inputs) -> tensor (or tuple of tensors)`` on ``device``, replayed from a CUDA graph per input
    shape in ``graph`` mode.

    Inputs may live on the host (pinned, for an asynchronous copy) or on the device; ``fn`` must not
    synchronise with the host (no ``.item()``, no data-dependent shapes) for it to be capturable. A
    shape whose capture fails runs eagerly from then on (logged once), so serving never breaks on an
    operation CUDA cannot capture. ``share_pool_with``: runners of one core share one memory pool.
    """

    def __init__(self, fn: Callable[..., Any], device: torch.device, mode: str = "eager",
                 share_pool_with: GraphRunner | None = None) -> None:
        if mode not in GRAPH_MODES:
            raise ValueError(f"unknown graph mode {mode!r}: choose {', '.join(GRAPH_MODES)}")
        if mode == "graph" and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.fn = fn
        self.device = device
        self.mode = mode
        self._graphs: dict[tuple[tuple[tuple[int, ...], torch.dtype], ...], _Graph | None] = {}
        self._pool: list[Any] = share_pool_with._pool if share_pool_with is not None else [None]
        self.replays = 0
        self.failed = 0

    @property
    def padded(self) -> bool:
        return self.mode != "eager"

    @property
    def captured(self) -> int:
        return sum(g is not None for g in self._graphs.values())

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if self.mode != "graph":
            if self.device.type == "cpu":  # host inputs already: not even a no-op .to() per input
                return self.fn(*inputs)
            return self.fn(*(x.to(self.device, non_blocking=True) for x in inputs))
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        entry = self._graphs.get(key)
        if entry is None:
            rows = max((x.shape[0] for x in inputs if x.dim()), default=0)
            if key in self._graphs or len(self._graphs) >= MAX_GRAPHS or rows > MAX_GRAPH_ROWS:
                return self.fn(*(x.to(self.device, non_blocking=True) for x in inputs))
            try:
                entry = self._capture(inputs)
            except RuntimeError as e:  # an operation that cannot be captured: this shape stays eager
                self.failed += 1
                self._graphs[key] = None
                _log.warning("CUDA graph capture failed for shapes %s, running them eagerly: %s",
                             [s for s, _ in key], str(e).splitlines()[0] if str(e) else type(e).__name__)
                import torch

                torch.cuda.synchronize(self.device)
                return self.fn(*(x.to(self.device, non_blocking=True) for x in inputs))
            self._graphs[key] = entry
        for static, x in zip(entry.inputs, inputs, strict=True):
            static.copy_(x, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.output

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> _Graph:
        import torch

        static = tuple(torch.empty(x.shape, dtype=x.dtype, device=self.device) for x in inputs)
        for s, x in zip(static, inputs, strict=True):
            s.copy_(x)
        # Warm up on a side stream first (lazy initialisation, cuBLAS workspaces), as torch's docs ask.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool[0], capture_error_mode="thread_local"):
            output = self.fn(*static)
        self._pool[0] = graph.pool()
        return _Graph(graph, static, output)
