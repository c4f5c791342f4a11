from __future__ import annotations

import numpy as np
import pytest

from recpipe.errors import BadRequest
from recpipe.serving import codec


@pytest.mark.parametrize("dtype", ["float32", "int64", "int32", "int8"])
def test_round_trip(dtype: str) -> None:
    a = (np.arange(24) - 5).astype(dtype).reshape(2, 3, 4)
    t = codec.encode(a)
    assert t.dtype == dtype and list(t.shape) == [2, 3, 4] and len(t.data) == a.nbytes
    np.testing.assert_array_equal(codec.decode(t, "x", dtype, (2, None, 4)), a)


def test_big_endian_input_is_sent_little_endian() -> None:
    a = np.arange(3, dtype=">i8")
    t = codec.encode(a)
    assert t.data == np.arange(3, dtype="<i8").tobytes()


def test_wrong_dtype_is_bad_request() -> None:
    t = codec.encode(np.zeros(3, np.float32))
    with pytest.raises(BadRequest, match="user_dense: expected dtype int64"):
        codec.decode(t, "user_dense", "int64")


def test_wrong_byte_length_is_bad_request() -> None:
    t = codec.encode(np.zeros(3, np.float32))
    t.data = t.data[:-1]
    with pytest.raises(BadRequest, match="bytes do not match shape"):
        codec.decode(t, "x", "float32")


def test_wrong_shape_is_bad_request() -> None:
    t = codec.encode(np.zeros((2, 3), np.float32))
    with pytest.raises(BadRequest, match=r"expected shape \[\*, 4\]"):
        codec.decode(t, "x", "float32", (None, 4))
    t.shape[:] = [-1, -6]
    with pytest.raises(BadRequest, match="negative dimension"):
        codec.decode(t, "x", "float32")


def test_ids_travel_as_int32_where_they_fit_and_decode_from_either_width() -> None:
    ids = np.arange(12, dtype=np.int64).reshape(3, 4)
    small = codec.encode_ids(ids, limit=1000)
    assert small.dtype == "int32" and len(small.data) == ids.size * 4
    np.testing.assert_array_equal(codec.decode_ids(small, "ids", (3, 4)), ids)
    wide = codec.encode_ids(ids, limit=2**40)  # ids that might not fit stay int64
    assert wide.dtype == "int64"
    np.testing.assert_array_equal(codec.decode_ids(wide, "ids", (3, 4)), ids)
    with pytest.raises(BadRequest, match="expected dtype int64, got float32"):
        codec.decode_ids(codec.encode(ids.astype(np.float32)), "ids")
