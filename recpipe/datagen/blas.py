"""Pin NumPy's OpenBLAS to one thread while generating.

The generator runs its own two threads; OpenBLAS's worker threads on top of them spin-wait for cores
that other processes hold, which made a (65536 x 16) @ (16 x 12) product ten times slower on the shared
development machine. One BLAS thread also keeps results independent of the machine's core count.
threadpoolctl does this in general; the OpenBLAS that NumPy wheels bundle needs only two symbols.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads")


def _openblas_libs() -> list[ctypes.CDLL]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line and ".so" in line}
    except OSError:  # not Linux: leave BLAS alone
        return []
    libs = []
    for path in sorted(paths):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libs


def _find(lib: ctypes.CDLL, names: tuple[str, ...]) -> Any:
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    return None


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    import numpy  # noqa: F401  (loads the bundled OpenBLAS so that it can be found)

    restore = []
    for lib in _openblas_libs():
        get, set_ = _find(lib, _GETTERS), _find(lib, _SETTERS)
        if get is None or set_ is None:
            continue
        get.restype = ctypes.c_int
        before = int(get())
        set_(1)
        restore.append((set_, before))
    try:
        yield
    finally:
        for set_, before in restore:
            set_(before)
