"""Staging to the device (DeviceIO) and host-memory tables: the CPU twin pads without pinning; the
``gpu`` test reads a host-mapped table in place and copies through pinned buffers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fast_path_support import CUDA

from recpipe.accel.transfer import DeviceIO, host_mapped
from recpipe.errors import UsageError
from recpipe.ranking.core import RankingCore


def test_device_io_on_the_cpu_copies_only_to_pad() -> None:
    io = DeviceIO(torch.device("cpu"))
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    same = io.put("a", a, np.float32)
    assert same.data_ptr() == a.ctypes.data  # unpadded on the CPU: the array itself
    padded = io.put("a", a, np.float32, rows=8)
    assert padded.shape == (8, 3) and not padded.is_pinned()
    np.testing.assert_array_equal(padded[:4].numpy(), a)
    assert (padded[4:] == 0).all()
    io.put("a", a[:1] + 100, np.float32, rows=8)  # the buffer is reused and re-zeroed
    assert padded[0, 0] == 100 and (padded[1:] == 0).all()
    out = io.fetch("out", torch.arange(8.0), 5)
    np.testing.assert_array_equal(out, np.arange(5.0))
    with io.stream():  # no stream on the CPU: a no-op
        pass


def test_host_tables_need_cuda(small_models: Path) -> None:
    with pytest.raises(UsageError, match="--embeddings host needs a CUDA device"):
        host_mapped(torch.zeros(3, 2), torch.device("cpu"))
    with pytest.raises(UsageError, match="--embeddings host needs a CUDA device"):
        RankingCore.load(small_models, device="cpu", embeddings="host")
    with pytest.raises(UsageError, match="--embeddings must be"):
        RankingCore.load(small_models, device="cpu", embeddings="disk")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_host_mapped_tensor_is_read_in_place_by_the_gpu() -> None:
    dev = torch.device("cuda:0")
    src = torch.randn(1000, 16)
    view = host_mapped(src, dev)
    assert view.device.type == "cuda"
    ids = torch.tensor([0, 5, 999], device=dev)
    torch.testing.assert_close(torch.nn.functional.embedding(ids, view).cpu(), src[[0, 5, 999]])
    io = DeviceIO(dev)
    host = io.put("x", np.ones((3, 2), np.float32), np.float32, rows=4)
    assert host.is_pinned() and host.shape == (4, 2)
    with io.stream():
        out = io.fetch("y", io.to_device(host) * 2, 3)
    np.testing.assert_array_equal(out, np.full((3, 2), 2.0, np.float32))
