"""ndarray <-> ``recpipe.v1.Tensor``: raw little-endian bytes + dtype + shape.

The only module besides the servicers that touches generated proto classes. Decoding validates
everything a peer could get wrong (dtype, byte length, shape) and raises ``BadRequest`` naming the field,
so a malformed tensor becomes INVALID_ARGUMENT and never an exception deep inside a model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recpipe.errors import BadRequest, clip
from recpipe.serving.status import code_for
from recpipe.v1 import batch_pb2, tensor_pb2

_ALLOWED = {"float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"}
# Looked up once: on the request path these small tensors make dtype construction, dtype.name and
# np.prod the dominant costs of encoding and decoding.
_LITTLE_ENDIAN = {name: np.dtype(name).newbyteorder("<") for name in _ALLOWED}
_WIRE_NAME = {dt: name for name, dt in _LITTLE_ENDIAN.items()}  # little-endian dtypes travel as they are


def encode(array: np.ndarray) -> tensor_pb2.Tensor:
    """Encode ``array`` (any layout, native or little-endian) as a Tensor message."""
    arr = np.asarray(array)
    name = _WIRE_NAME.get(arr.dtype)
    if name is None:
        name = arr.dtype.name
        if name not in _ALLOWED:
            raise BadRequest(f"cannot encode dtype {name}")
        arr = arr.astype(_LITTLE_ENDIAN[name], copy=False)
    # tobytes() writes C order whatever the layout.
    return tensor_pb2.Tensor(dtype=name, shape=arr.shape, data=arr.tobytes())


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
        raise BadRequest(f"{field}: expected dtype {dtype}, got {clip(tensor.dtype) or '(empty)'}")
    dims = tuple(tensor.shape)
    count = 1
    for d in dims:
        if d < 0:
            raise BadRequest(f"{field}: negative dimension in shape {_shape(dims)}")
        count *= d
    if shape is not None and (
        len(dims) != len(shape) or any(w is not None and w != d for w, d in zip(shape, dims, strict=True))
    ):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise BadRequest(f"{field}: expected shape {want}, got {_shape(dims)}")
    dt = _LITTLE_ENDIAN.get(dtype) or np.dtype(dtype).newbyteorder("<")
    expected = count * dt.itemsize
    data = tensor.data  # each read of a bytes field copies it out of the message: read it once
    if len(data) != expected:
        raise BadRequest(
            f"{field}: {len(data)} bytes do not match shape {_shape(dims)} of {dtype} ({expected} bytes)"
        )
    arr = np.frombuffer(data, dtype=dt).reshape(dims)
    return arr if dt.isnative else arr.astype(dt.newbyteorder("="))


#: the integer dtypes an id tensor may travel in: int32 where every id fits (what recpipe sends), int64
ID_DTYPES = ("int32", "int64")


def decode_ids(tensor: tensor_pb2.Tensor, field: str, shape: Sequence[int | None] | None = None) -> np.ndarray:
    """``decode`` for a tensor of ids, in either of ``ID_DTYPES`` (a view; the consumer widens if it
    must)."""
    dtype = tensor.dtype if tensor.dtype in ID_DTYPES else "int64"
    return decode(tensor, field, dtype, shape)


def encode_ids(ids: np.ndarray, limit: int) -> tensor_pb2.Tensor:
    """Encode ids below ``limit`` as int32 when they fit (half the bytes of int64), else as they are."""
    arr = np.asarray(ids)
    if arr.dtype != np.int32 and limit <= np.iinfo(np.int32).max:
        arr = arr.astype(np.int32)
    return encode(arr)


def _shape(dims: Sequence[int]) -> str:
    """A client's shape for an error message, bounded like every echoed value (it may have 500,000 dims)."""
    if len(dims) <= 16:
        return clip(list(dims))
    return f"[{', '.join(str(d) for d in dims[:8])}, ...] ({len(dims)} dims)"


#: An entry's error message is cut like a whole call's status message.
MAX_ENTRY_DETAILS = 1000


def entry_error(error: BaseException) -> batch_pb2.EntryError:
    """The ``EntryError`` of a batch entry that failed with ``error``: the status code it would have
    had as a unary call (``recpipe.serving.status``) and its message, bounded."""
    return batch_pb2.EntryError(code=code_for(error).value[0], message=clip(str(error), MAX_ENTRY_DETAILS))
