"""How fast this machine's CPU ran, on fixed work, when the characterization started.

Two machines of one kind are not one machine: on two leases of the same H200 box the same in-process
code ran 0.56-0.82x as fast on one as on the other (a slower or busier host CPU), and every figure the
CPU bounds moved with it. ``probe()`` times three fixed pieces of work on one thread, a few rounds each:

- ``sha256_mbps``: MB/s of SHA-256 over 8 MiB (hashlib, integer units);
- ``matmul_gflops``: GFLOP/s of a 256 x 256 float32 matrix product in torch (the vector units the CPU
  forms and FAISS run on; None without torch);
- ``copy_gbps``: GB/s of a 64 MiB memory copy (numpy);

each as the best round (what the CPU can do) and the median (what it did while the probe ran), with
the share of the probe's CPU time the hypervisor took (``steal``, from /proc/stat; None where the
kernel does not say). ``recpipe report`` sets them side by side and says when two documents that name
the same CPU ran it at different speeds. Compiled code only: a pure-Python loop timed here moved by
up to 1.6x between two fresh processes on one machine (with torch imported or not), the hash by 3%.
The probe takes well under a second once torch is imported.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from recpipe import cputime

#: bytes hashed, and copied, per round
HASH_BYTES = 8 << 20
COPY_BYTES = 64 << 20
#: matrix side and products per round
MATMUL_N = 256
MATMUL_REPS = 40
ROUNDS = 5


def _rounds(work: Callable[[], float], rounds: int) -> list[float]:
    """``work`` once to warm up, then ``rounds`` times: its rates."""
    work()
    return [work() for _ in range(rounds)]


def _sha256(rounds: int) -> list[float]:
    data = bytes(HASH_BYTES)

    def once() -> float:
        t0 = time.perf_counter()
        hashlib.sha256(data).digest()
        return HASH_BYTES / (time.perf_counter() - t0) / 1e6

    return _rounds(once, rounds)


def _copy(rounds: int) -> list[float]:
    src = np.ones(COPY_BYTES, np.uint8)
    dst = np.empty_like(src)

    def once() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return COPY_BYTES / (time.perf_counter() - t0) / 1e9

    return _rounds(once, rounds)


def _matmul(rounds: int) -> list[float] | None:
    try:
        import torch
    except ImportError:
        return None
    from recpipe.serving.threads import torch_threads

    with torch_threads(1):
        a, b = torch.rand(MATMUL_N, MATMUL_N), torch.rand(MATMUL_N, MATMUL_N)

        def once() -> float:
            t0 = time.perf_counter()
            for _ in range(MATMUL_REPS):
                torch.mm(a, b)
            return 2.0 * MATMUL_N**3 * MATMUL_REPS / (time.perf_counter() - t0) / 1e9

        return _rounds(once, rounds)


def _summary(rates: list[float]) -> dict[str, float]:
    return {"best": round(max(rates), 3), "median": round(statistics.median(rates), 3)}


#: (key, unit) of each measure, in the order a report gives them
MEASURES = (("sha256_mbps", "MB/s SHA-256"), ("matmul_gflops", "GFLOP/s matmul"), ("copy_gbps", "GB/s copy"))


def probe(rounds: int = ROUNDS) -> dict[str, Any]:
    """{"sha256_mbps": {"best", "median"}, "matmul_gflops": {...} or None, "copy_gbps": {...},
    "steal": fraction or None, "rounds", "elapsed_s"}."""
    t0 = time.perf_counter()
    before = cputime.machine_ticks()
    sha, matmul, copy = _sha256(rounds), _matmul(rounds), _copy(rounds)
    after = cputime.machine_ticks()
    steal = None
    if before is not None and after is not None and after.total > before.total:
        steal = round((after.steal - before.steal) / (after.total - before.total), 4)
    return {"sha256_mbps": _summary(sha), "matmul_gflops": _summary(matmul) if matmul else None,
            "copy_gbps": _summary(copy), "steal": steal, "rounds": rounds,
            "elapsed_s": round(time.perf_counter() - t0, 3)}


def describe(block: dict[str, Any] | None) -> str:
    """One line for a report, e.g. ``"1,531 MB/s SHA-256, 83.8 GFLOP/s matmul, 6.7 GB/s copy (one thread,
    best of 5; medians 1,530 / 83.1 / 6.1), steal 0.0%"``; ``"-"`` for a document from before the probe."""
    if not block:
        return "-"
    present = [(key, unit) for key, unit in MEASURES if block.get(key)]
    best = ", ".join(f"{_num(block[key]['best'])} {unit}" for key, unit in present)
    medians = " / ".join(_num(block[key]["median"]) for key, _ in present)
    text = f"{best} (one thread, best of {block['rounds']}; medians {medians})"
    if block.get("steal") is not None:
        text += f", steal {100 * block['steal']:.1f}%"
    return text


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def speed_ratio(base: dict[str, Any] | None, other: dict[str, Any] | None) -> float | None:
    """How fast other's CPU ran against base's: the geometric mean of the SHA-256 and matmul best-round
    ratios (those both measured), or None where either document has no probe."""
    if not base or not other:
        return None
    ratios = [float(other[key]["best"]) / float(base[key]["best"])
              for key in ("sha256_mbps", "matmul_gflops") if base.get(key) and other.get(key)]
    return float(np.prod(ratios) ** (1 / len(ratios))) if ratios else None
