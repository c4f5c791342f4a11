"""The process-wide settings a training run changes, each put back when the run returns or raises.

``recpipe train`` runs in its caller's process (tests, ``recpipe.cli.main``, a notebook), so what it
turns on for itself must not outlive it. A CUDA run multiplies float32 matrices in TF32, and any run
sets torch's intra-op threads; left on, TF32 made a later test in the same session, comparing CUDA
scores with the CPU's, fail on an H200 (relative difference 3.6e-4 against rtol 1e-4).

Put back elsewhere: ``OMP_WAIT_POLICY`` (``threads.import_with_sleeping_workers``) and FAISS's own
thread count around its timings (``recpipe.retrieval.index``). Not snapshotted: glibc's malloc settings
(``heap.kept_heap`` sets glibc's defaults back; malloc has no getter) and the seeds each run gives its
own generators. cuDNN's TF32 flag is left alone: it governs convolutions and RNNs, which these models
have none of.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from recpipe.serving.threads import torch_threads


@contextlib.contextmanager
def tf32_matmuls(enabled: bool = True) -> Iterator[None]:
    """CUDA float32 matmuls in TF32 within the block (when ``enabled``); the setting they had comes back
    after it, also when the block raises. The flags can be set on a CPU-only build, where they change
    nothing.

    Recent torch keeps two records of it: the float32 matmul precision (``allow_tf32``,
    ``set_float32_matmul_precision``) and a precision per backend
    (``torch.backends.cuda.matmul.fp32_precision``). Where they disagree, reading the first raises: in
    ``torch.compile``, the profiler and, in some versions, the cuBLAS handle's set-up. So this never
    makes them disagree: it writes through ``allow_tf32``, which sets both, unless the process already
    uses the per-backend record alone (the first cannot be read), and puts back exactly what it found
    (torch 2.13: every record and getter as before, from each of the states the tests start from).
    """
    if not enabled:
        yield
        return
    import torch

    matmul = torch.backends.cuda.matmul
    try:
        already = bool(matmul.allow_tf32)
    except RuntimeError:  # the two records disagree: the caller sets the per-backend one alone
        previous = matmul.fp32_precision
        matmul.fp32_precision = "tf32"
        try:
            yield
        finally:
            matmul.fp32_precision = previous
        return
    if already:  # "high" or "medium": setting it again would turn "medium" into "high"
        yield
        return
    backend = getattr(matmul, "fp32_precision", None)  # "none" (inherit) or "ieee"; None before torch 2.4
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = False
        if backend is not None:
            matmul.fp32_precision = backend


@contextlib.contextmanager
def training_settings(threads: int, tf32: bool) -> Iterator[None]:
    """A training run's settings within the block: ``threads`` torch threads (``recpipe.serving.threads.torch_threads``)
    and, with ``tf32``, TF32 CUDA matmuls; the caller's come back after it, also when it raises."""
    with torch_threads(threads), tf32_matmuls(tf32):
        yield
