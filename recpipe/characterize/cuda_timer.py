"""The data-paths section's ``DeviceTimer`` on a CUDA device (``recpipe.characterize.datapaths``).

Buffers are allocated once, at the largest size the plan copies, and sliced per operation: a pinned
host buffer (``pin_memory=True``, what ``DeviceIO`` stages requests in), a pageable one (touched first,
so no page fault is timed), a device buffer, and for the gathers one table of ``Plan.table_bytes`` in
pinned host memory mapped for the GPU (``recpipe.accel.transfer.host_mapped``, as ``--embeddings
host`` builds the DLRM tables) and its copy in GPU memory, each viewed as (rows, dim) of the dtype
asked. Row ids are drawn once per (rows, order) on the device, from a seeded generator.

Device clock: a pair of ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream around
each run, all runs enqueued back to back, one synchronize, ``elapsed_time`` per pair. Host clock:
``perf_counter`` around a blocking ``copy_`` and ``torch.cuda.synchronize`` (a plain torch copy, as
user code does it).

First run at 435868d on an H200 machine (docs/characterize-data-paths.md); the section's arithmetic
and document are also tested with a fake timer (tests/unit).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from recpipe.accel import device as devices
from recpipe.characterize.datapaths import DEVICE, H2D, HOST, SORTED, Copy, Gather, Plan

if TYPE_CHECKING:
    import torch

_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16"}


def unavailable(device: str) -> str | None:
    """Why the section cannot run for ``--device device`` (None: it can, on ``cuda:0``)."""
    if device == "cpu":
        return "CPU run (--device cpu)"
    if devices.no_gpu():
        return "no GPU on this machine"
    import torch

    if not torch.cuda.is_available():
        return "no GPU on this machine (torch sees no CUDA device)"
    return None


class CudaTimer:
    """``with CudaTimer(plan) as timer: datapaths.measure(plan, tables, timer)`` (see module doc)."""

    def __init__(self, plan: Plan, device: str = "cuda") -> None:
        import torch

        self.torch = torch
        self.device = devices.resolve(device)
        self.plan = plan
        biggest = max((*plan.copy_bytes, plan.small_bytes, plan.check_bytes))
        self._pinned = torch.empty(biggest, dtype=torch.uint8, pin_memory=True)
        self._pinned.fill_(1)
        self._pageable = torch.empty(biggest, dtype=torch.uint8)
        self._pageable.fill_(1)
        self._dev = torch.empty(biggest, dtype=torch.uint8, device=self.device)
        self._tables: dict[str, torch.Tensor] = {}
        self._ids: dict[tuple[int, int, str], torch.Tensor] = {}
        self._out: torch.Tensor | None = None

    def __enter__(self) -> CudaTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the buffers (the process goes on to other work)."""
        self._tables.clear()
        self._ids.clear()
        self._out = None
        self._pinned = self._pageable = self._dev = self.torch.empty(0)
        self.torch.cuda.empty_cache()

    def describe(self) -> str:
        return devices.describe(self.device)

    def time(self, op: Copy | Gather, repeats: int, warmup: int, clock: str = DEVICE) -> list[float]:
        torch = self.torch
        run = self._runner(op, blocking=clock == HOST)
        with torch.cuda.device(self.device):
            for _ in range(warmup):
                run()
            torch.cuda.synchronize(self.device)
            if clock == HOST:
                out = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    run()
                    torch.cuda.synchronize(self.device)
                    out.append(time.perf_counter() - t0)
                return out
            stream = torch.cuda.current_stream(self.device)
            pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(repeats)]
            for start, end in pairs:
                start.record(stream)
                run()
                end.record(stream)
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) / 1e3 for start, end in pairs]  # ms -> s

    def _runner(self, op: Copy | Gather, blocking: bool) -> Callable[[], Any]:
        if isinstance(op, Copy):
            host = (self._pinned if op.pinned else self._pageable)[: op.nbytes]
            dev = self._dev[: op.nbytes]
            if op.direction == H2D:
                return lambda: dev.copy_(host, non_blocking=not blocking)
            return lambda: host.copy_(dev, non_blocking=not blocking)
        table = self._table(op.where).view(getattr(self.torch, _TORCH_DTYPES[op.dtype]))
        rows = op.rows
        view = table[: rows * op.dim].view(rows, op.dim)
        ids = self._row_ids(rows, op.lookups, op.order)
        out = self.torch.empty((op.lookups, op.dim), dtype=view.dtype, device=self.device)
        self._out = out  # kept alive across the runs
        return lambda: self.torch.index_select(view, 0, ids, out=out)

    def _table(self, where: str) -> torch.Tensor:
        """The plan's table as a float32 CUDA tensor: in GPU memory, or in pinned host memory mapped
        for the GPU to read in place (the same values in both)."""
        if where not in self._tables:
            from recpipe.accel.transfer import host_mapped

            torch = self.torch
            if HOST not in self._tables:
                values = torch.empty(self.plan.table_bytes // 4, dtype=torch.float32).uniform_(-1, 1)
                self._tables[HOST] = host_mapped(values, self.device)
                del values
            if where == DEVICE:
                self._tables[DEVICE] = self._tables[HOST].clone()  # a copy in GPU memory
        return self._tables[where]

    def _row_ids(self, rows: int, lookups: int, order: str) -> torch.Tensor:
        key = (rows, lookups, order)
        if key not in self._ids:
            torch = self.torch
            gen = torch.Generator(device=self.device)
            gen.manual_seed(rows)  # the same ids for both placements and both orders of one row size
            ids = torch.randint(0, rows, (lookups,), generator=gen, device=self.device)
            self._ids[key] = ids.sort().values if order == SORTED else ids
        return self._ids[key]
