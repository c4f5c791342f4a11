"""Host <-> device transfers on the request path: pinned staging buffers, one stream, host-mapped tables.

- ``DeviceIO.put`` writes a request's numpy array into a reusable host buffer (padded with zeros to
  the bucket size when asked). On CUDA the buffer is pinned (page-locked), so the copy to the device
  that follows is asynchronous (``non_blocking``); on the CPU, unpadded, it is the array itself and
  nothing is copied.
- ``DeviceIO.fetch`` copies a device result into a pinned buffer asynchronously, waits for the
  stage's stream once, and returns a numpy copy (the buffer is reused by the next call).
- ``DeviceIO.stream()``: every core call of a stage process runs on one CUDA stream of its own, not
  on the legacy default stream (a no-op on the CPU); ``hand_over`` gives a device result of that
  stream to a caller on another.
- ``host_mapped``: a CUDA tensor whose storage stays in pinned host memory, read by the GPU in place
  (zero-copy over UVA: PCIe on x86, NVLink-C2C on Grace Hopper).
- ``DeviceIO.traffic``: the bytes and copies each way (``recpipe.accel.traffic``). A ``put`` on CUDA
  stages one copy to the device (the caller's ``.to``/``copy_`` of the tensor it returns), counted
  there; a ``fetch`` counts the copies back. On the CPU nothing crosses and only the calls count.

A staging buffer is reused call after call: before the host writes one again, ``put`` waits for the
event recorded when the last ``stream()`` block ended (free when ``fetch`` already waited for it), so
an asynchronous copy out of the buffer is never overtaken by the next request's data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from recpipe.accel.traffic import Traffic
from recpipe.errors import UsageError

_NULL = contextlib.nullcontext()
_TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.int64): torch.int64}


class DeviceIO:
    """Staging buffers and the stream of one stage's core on ``device`` (see module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._done = torch.cuda.Event() if self.cuda else None
        #: what the calls copied so far (read by GetInfo; plain ints, so a reading is never torn)
        self.traffic = Traffic()

    def stream(self) -> contextlib.AbstractContextManager[Any]:
        """Run the body on the stage's CUDA stream (a shared null context on the CPU)."""
        return _NULL if self._stream is None else self._on_stream()

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        assert self._stream is not None and self._done is not None
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            self._done.record(self._stream)

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            capacity = 1 << max(numel - 1, 0).bit_length()
            buf = torch.empty(capacity, dtype=dtype, pin_memory=self.cuda)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def put(self, name: str, array: np.ndarray, dtype: type, rows: int | None = None) -> torch.Tensor:
        """``array`` (n, ...) as a host tensor of ``rows`` >= n rows (zeros after row n), ready for an
        asynchronous copy to the device. On the CPU without padding: the array itself, no copy."""
        arr = np.asarray(array)
        n = arr.shape[0]
        rows = n if rows is None else rows
        if not self.cuda and rows == n:
            a: np.ndarray = np.ascontiguousarray(arr, dtype=dtype)
            if not a.flags.writeable:  # torch warns on read-only buffers (e.g. decoded from a message)
                a = a.copy()
            return torch.from_numpy(a)
        if self._done is not None:
            self._done.synchronize()  # the last block's copies out of the buffers are done
        host = self._buffer(name, (rows, *arr.shape[1:]), _TORCH_DTYPES[np.dtype(dtype)])
        view = host.numpy()
        view[:n] = arr
        view[n:] = 0
        if self.cuda:
            self.traffic.add_h2d(host.nbytes)
        return host

    def hand_over(self, result: torch.Tensor) -> torch.Tensor:
        """A device tensor computed on the stage's stream, made safe for the caller's current stream:
        that stream waits for this one's work so far, and the allocator keeps the memory until the
        caller's work on it is done too. Without it a caller's ``.cpu()`` on the default stream could
        read the tensor before the stage's stream wrote it (a bench computed its recall against stale
        query vectors that way). A no-op off CUDA."""
        if self._stream is None or result.device.type != "cuda":
            return result
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        result.record_stream(current)
        return result

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def fetch(self, name: str, result: torch.Tensor, n: int) -> np.ndarray:
        """The first ``n`` rows of a device ``result`` as a numpy array of the caller's own."""
        return self.fetch_many([(name, result)], n)[0]

    def fetch_many(self, results: list[tuple[str, torch.Tensor]], n: int) -> list[np.ndarray]:
        """``fetch`` for several results with one wait for the stream."""
        self.traffic.add_call()
        if not self.cuda:
            outs = [r[:n].numpy() for _, r in results]
            return [o if n == r.shape[0] else o.copy() for o, (_, r) in zip(outs, results, strict=True)]
        hosts = []
        for name, result in results:
            host = self._buffer(name, (n, *result.shape[1:]), result.dtype)
            host.copy_(result[:n], non_blocking=True)
            self.traffic.add_d2h(host.nbytes)
            hosts.append(host)
        torch.cuda.current_stream(self.device).synchronize()
        return [h.numpy().copy() for h in hosts]


class _CudaArrayView:
    """``__cuda_array_interface__`` over a pinned host tensor (kept alive by the tensor torch builds)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.int64: "<i8"}[host.dtype]
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": tuple(host.shape), "typestr": typestr, "data": (host.data_ptr(), False), "version": 2,
            "strides": None,
        }


def host_mapped(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` in pinned host memory, as a tensor on CUDA ``device`` that reads it in place.

    With unified virtual addressing (every 64-bit CUDA process), memory from ``cudaHostAlloc`` -- what
    ``pin_memory=True`` allocates -- is mapped into every device's address space at the same address,
    so the GPU's kernels can read it directly, a cache line at a time over the bus, with no copy to
    device memory. torch builds a CUDA tensor over such a pointer through ``__cuda_array_interface__``
    (it checks that the pointer is registered with CUDA, and keeps the host tensor alive).
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UsageError("--embeddings host needs a CUDA device (the tables are mapped for the GPU to read)")
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor.detach().cpu())
    with torch.cuda.device(device):
        view = torch.as_tensor(_CudaArrayView(host), device=device)
    if view.data_ptr() != host.data_ptr() or view.device.type != "cuda":
        raise RuntimeError("torch copied the host tables instead of mapping them")
    return view
