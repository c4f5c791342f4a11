"""ndarray <-> ``recpipe.v1.Tensor``: raw little-endian bytes + dtype + shape.

The only module besides the servicers that touches generated proto classes. Decoding validates
everything a peer could get wrong (dtype, byte length, shape) and raises ``BadRequest`` naming the field,
so a malformed tensor becomes INVALID_ARGUMENT and never an exception deep inside a model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recpipe.errors import BadRequest
from recpipe.v1 import tensor_pb2

_ALLOWED = {"float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"}


def encode(array: np.ndarray) -> tensor_pb2.Tensor:
    """Encode ``array`` (any layout, native or little-endian) as a Tensor message."""
    arr = np.asarray(array)
    name = arr.dtype.name
    if name not in _ALLOWED:
        raise BadRequest(f"cannot encode dtype {name}")
    le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return tensor_pb2.Tensor(dtype=name, shape=list(arr.shape), data=np.ascontiguousarray(le).tobytes())


def decode(
    tensor: tensor_pb2.Tensor,
    field: str,
    dtype: str,
    shape: Sequence[int | None] | None = None,
) -> np.ndarray:
    """Decode ``tensor`` and check it is ``dtype`` with ``shape`` (``None`` entries match any size).

    Returns a read-only view over the message bytes (no copy). ``field`` names the tensor in errors.
    """
    if tensor.dtype != dtype:
        raise BadRequest(f"{field}: expected dtype {dtype}, got {tensor.dtype or '(empty)'}")
    dims = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in dims):
        raise BadRequest(f"{field}: negative dimension in shape {list(dims)}")
    if shape is not None and (
        len(dims) != len(shape) or any(w is not None and w != d for w, d in zip(shape, dims, strict=True))
    ):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise BadRequest(f"{field}: expected shape {want}, got {list(dims)}")
    dt = np.dtype(dtype).newbyteorder("<")
    expected = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    if len(tensor.data) != expected:
        raise BadRequest(
            f"{field}: {len(tensor.data)} bytes do not match shape {list(dims)} of {dtype} ({expected} bytes)"
        )
    arr = np.frombuffer(tensor.data, dtype=dt).reshape(dims)
    return arr if dt.isnative else arr.astype(dt.newbyteorder("="))
