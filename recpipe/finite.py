"""Model outputs that must not leave a stage as a success: NaN/inf scores, degenerate query vectors.

Finite but extreme inputs (dense features of 3e38, far outside anything seen in training) overflow
float32 inside the models: the DLRM then scores NaN, and the user tower's L2 normalisation turns an
infinite activation into a zero vector, which FAISS would happily search with. The retrieval core
reports such a query's scores as NaN (``degenerate``); the Rank and Retrieve servicers refuse
non-finite scores per request (``check_finite``), so a bad request in a batch fails alone, with
INVALID_ARGUMENT "the features are out of the model's range". Inputs are not clamped instead: the
repository does not record the training range of every dense input, and a clamped answer to such a
request would be a confident-looking guess.
"""

from __future__ import annotations

import numpy as np

from recpipe.errors import BadRequest

OUT_OF_RANGE = "the features are out of the model's range"
#: How far an L2-normalised embedding's norm may stray from 1 (float32 rounding is ~1e-7).
UNIT_NORM_TOLERANCE = 1e-3


def check_finite(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` unchanged when every entry is finite, else ``BadRequest`` naming ``what``."""
    finite = np.isfinite(values)
    if not finite.all():
        raise BadRequest(f"{what}: {OUT_OF_RANGE} ({values.size - int(finite.sum())} of {values.size} "
                         "outputs are NaN or infinite)")
    return values


def degenerate(norms: np.ndarray) -> np.ndarray:
    """(B,) bool: which L2-normalised embeddings (given their norms) are not unit vectors, i.e. came
    from an input that overflowed (a zero or NaN vector)."""
    return ~(np.abs(norms - 1.0) <= UNIT_NORM_TOLERANCE)
