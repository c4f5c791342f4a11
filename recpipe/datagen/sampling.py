"""Fast batched sampling from many discrete distributions at once.

``np.searchsorted`` with random keys over a large cumulative table is dominated by cache misses
(~0.5 µs a key over 850k entries); with *sorted* keys it is several times faster. Sorting the keys
would need an argsort to map results back, and argsort is slow too, so each key is packed into one
int64 as ``(row, uniform, position-in-batch)``: a plain ``np.sort`` of int64 (SIMD, fast) orders the
keys and the low bits say where each result goes.
"""

from __future__ import annotations

import numpy as np

#: Rows per sampling batch are at most 2**BATCH_BITS (their position is packed in the low bits).
BATCH_BITS = 20
MAX_BATCH = 1 << BATCH_BITS
_KEY_BITS = 62


class PackedTable:
    """Discrete distributions, one per row, laid out flat and grouped by row.

    ``row_of[j]`` is the row of entry ``j`` (non-decreasing) and ``cum_share[j]`` the cumulative share
    of the row's mass up to and including entry ``j`` (the last entry of a row is exactly 1.0).
    ``sample(rows, r)`` returns the flat index of one entry per query, drawn from that query's row.
    """

    def __init__(self, cum_share: np.ndarray, row_of: np.ndarray, n_rows: int) -> None:
        row_bits = max(1, int(n_rows - 1).bit_length())
        self.uniform_bits = _KEY_BITS - BATCH_BITS - row_bits
        if self.uniform_bits < 24:
            raise ValueError(f"too many rows ({n_rows}) for packed sampling")
        share = np.rint(cum_share * float(1 << self.uniform_bits)).astype(np.int64)
        self._keys = (((row_of.astype(np.int64) << self.uniform_bits) + share) << BATCH_BITS) | (MAX_BATCH - 1)

    def uniforms(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """The random numbers ``sample`` consumes: integers in 1..2**uniform_bits."""
        return rng.integers(1, (1 << self.uniform_bits) + 1, n, dtype=np.int64)

    def sample(self, rows: np.ndarray, r: np.ndarray) -> np.ndarray:
        pos, idx = self.sample_sorted(rows, r)
        out = np.empty(rows.shape[0], np.int64)
        out[idx] = pos
        return out

    def sample_sorted(self, rows: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Like ``sample``, but as (flat index, query index) pairs in ascending flat-index order (per
        batch of MAX_BATCH queries): gathering per-entry data in this order reads memory sequentially."""
        n = rows.shape[0]
        pos = np.empty(n, np.int64)
        idx = np.empty(n, np.int64)
        for lo in range(0, n, MAX_BATCH):
            hi = min(n, lo + MAX_BATCH)
            q = ((rows[lo:hi].astype(np.int64) << self.uniform_bits) + r[lo:hi]) << BATCH_BITS
            q |= np.arange(hi - lo, dtype=np.int64)
            q.sort()
            pos[lo:hi] = np.searchsorted(self._keys, q, side="left")
            idx[lo:hi] = lo + (q & (MAX_BATCH - 1))
        return pos, idx


def table_from_weights(weights: np.ndarray) -> PackedTable:
    """A PackedTable for a dense (rows, width) weight matrix; flat index = row * width + column."""
    cum = np.cumsum(weights, axis=1)
    cum /= cum[:, -1:]
    cum[:, -1] = 1.0
    rows = np.repeat(np.arange(weights.shape[0]), weights.shape[1])
    return PackedTable(cum.ravel(), rows, weights.shape[0])


def gather_dot(a: np.ndarray, ai: np.ndarray, b: np.ndarray, bi: np.ndarray, chunk: int = 1 << 15) -> np.ndarray:
    """``sum(a[ai] * b[bi], axis=1)`` for float32 (n, k) tables, without materialising the gathers.

    Rows are gathered as opaque k*4-byte records (``np.take`` on a void view is several times faster
    than fancy indexing of a 2-D array) into small reused buffers that stay in cache.
    """
    k = a.shape[1]
    av = np.ascontiguousarray(a).view(f"V{4 * k}").ravel()
    bv = np.ascontiguousarray(b).view(f"V{4 * k}").ravel()
    n = ai.shape[0]
    out = np.empty(n, np.float32)
    abuf = np.empty(min(n, chunk), av.dtype)
    bbuf = np.empty(min(n, chunk), bv.dtype)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        m = hi - lo
        np.take(av, ai[lo:hi], out=abuf[:m])
        np.take(bv, bi[lo:hi], out=bbuf[:m])
        x = abuf[:m].view(np.float32).reshape(m, k)
        y = bbuf[:m].view(np.float32).reshape(m, k)
        np.einsum("ij,ij->i", x, y, out=out[lo:hi])
    return out


def take_rows(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[idx]`` for a C-contiguous 2-D array, gathering rows as opaque records (much faster)."""
    rec = np.ascontiguousarray(a).view(f"V{a.shape[1] * a.dtype.itemsize}").ravel()
    return np.take(rec, idx).view(a.dtype).reshape(idx.shape[0], a.shape[1])
