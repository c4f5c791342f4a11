"""What machine a run was measured on: CPU model, cores, GPU (or none), OS and library versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

LIBRARIES = ("recpipe", "grpcio", "protobuf", "numpy", "polars", "pyarrow", "torch", "faiss-cpu",
             "faiss-gpu-cu12", "hdrhistogram", "matplotlib")

_CUDA_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidia0", "/dev/nvidiactl")


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo on Linux, ``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            # x86 says "model name"; Arm server kernels (e.g. Grace) may only give "CPU part" ids.
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpu_name() -> str:
    """The first GPU's name from ``nvidia-smi`` or ``torch.cuda``; ``"none"`` when there is none."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10, check=False)
            names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
            if out.returncode == 0 and names:
                return names[0] if len(names) == 1 else f"{names[0]} x{len(names)}"
        except (OSError, subprocess.SubprocessError):
            pass
    # Importing torch costs seconds: only ask it when it is loaded already or a CUDA driver is present.
    if "torch" not in sys.modules and not any(Path(p).exists() for p in _CUDA_DRIVER_PATHS):
        return "none"
    try:
        import torch
    except ImportError:
        return "none"
    if torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    return "none"


def library_versions() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def detect() -> dict[str, Any]:
    """The ``platform`` block of a run: describes the machine the *generator* ran on.

    The services report their own device through InfoService (recorded under ``pipeline``).
    """
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "gpu": gpu_name(),
        "machine": platform.machine(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "hostname": platform.node(),
        "libraries": library_versions(),
        # gRPC core's experiments, where the user set them (they change its cost per call); None = defaults
        "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS"),
    }
