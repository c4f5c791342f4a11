"""The GPU's busy fraction over a stretch of the run, sampled in a background thread.

Samples ``nvidia-smi --query-gpu=utilization.gpu`` (else ``torch.cuda.utilization()``, which asks NVML
too) every ``interval_s``. Without a GPU, or on a CPU-only run, nothing is sampled and the result says
why. It sampled on the H200 runs of BENCHMARKS.md.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any


def _smi_reader() -> Callable[[], float | None] | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None

    def read() -> float | None:
        try:
            out = subprocess.run([smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5, check=False)
            return float(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    return read if read() is not None else None


def _torch_reader() -> Callable[[], float | None] | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None

    def read() -> float | None:
        try:
            return float(torch.cuda.utilization(0))
        except Exception:
            return None

    return read if read() is not None else None


class BusySampler:
    """``with BusySampler(enabled) as s: ...`` then ``s.result()``."""

    def __init__(self, enabled: bool, interval_s: float = 0.5, why_not: str = "") -> None:
        self.interval_s = interval_s
        self._why_not = why_not
        self._read = (_smi_reader() or _torch_reader()) if enabled else None
        if enabled and self._read is None:
            self._why_not = "no nvidia-smi and no torch.cuda utilization reading"
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BusySampler:
        if self._read is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-busy", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        assert self._read is not None
        while not self._stop.wait(self.interval_s):
            value = self._read()
            if value is not None:
                self._samples.append(value)

    def mark(self) -> int:
        """Where the samples stand now, for ``fraction_since`` (a part of the stretch, e.g. a sweep point)."""
        return len(self._samples)

    def fraction_since(self, mark: int) -> float | None:
        """The busy fraction of the samples read since ``mark`` (None: none was)."""
        part = self._samples[mark:]
        return round(sum(part) / len(part) / 100, 4) if part else None

    def result(self) -> dict[str, Any]:
        if self._read is None:
            return {"measured": False, "reason": self._why_not or "not sampled"}
        n = len(self._samples)
        return {"measured": n > 0, "samples": n, "interval_s": self.interval_s,
                "busy_fraction": round(sum(self._samples) / n / 100, 4) if n else None,
                "reason": "" if n else "no sample was read"}
