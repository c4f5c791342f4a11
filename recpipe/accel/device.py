"""Resolve a ``--device auto|cpu|cuda[:N]`` flag to a ``torch.device`` and a human description.

``import torch`` costs seconds, so the CPU is decided without it where that is certain (``cpu``, or
``auto`` on a machine with no GPU driver: ``no_gpu``): ``resolve_name`` and ``describe`` then leave
torch unloaded for a stage that runs without it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from recpipe.errors import UsageError

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
#: Present wherever torch could find a CUDA device: the NVIDIA driver's control device and its /proc
#: entry, WSL's GPU bridge, and ROCm's kernel driver (a ROCm torch calls its GPUs "cuda" too).
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def no_gpu() -> bool:
    """True when this process certainly sees no CUDA device, decided without importing torch:
    ``CUDA_VISIBLE_DEVICES`` hides them all (empty, or its first entry -1) or no GPU driver is
    installed (``GPU_DRIVER_FILES``). False means only "maybe": torch has to be asked."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.split(",")[0].strip() in ("", "-1"):
        return True
    return not any(os.path.exists(p) for p in GPU_DRIVER_FILES)


def certainly_cpu(device: str = "auto") -> bool:
    """``device`` resolves to the CPU, known without importing torch (``cpu``, or ``auto`` with ``no_gpu``)."""
    name = (device or "auto").strip().lower()
    return name == "cpu" or (name == "auto" and no_gpu())


def resolve(device: str = "auto") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is a ``UsageError``."""
    import torch

    name = (device or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UsageError(f"device {device!r} requested but CUDA is not available on this machine")
        dev = torch.device("cuda:0" if name == "cuda" else name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
        return dev
    raise UsageError(f"unknown device {device!r}: choose auto, cpu or cuda")


def resolve_name(device: str = "auto") -> str:
    """``resolve(device)`` as torch spells it ("cpu", "cuda:0"), without importing torch where the
    answer is certainly the CPU (``certainly_cpu``)."""
    return "cpu" if certainly_cpu(device) else str(resolve(device))


def kind(dev: torch.device | str) -> str:
    """The device's type ("cpu", "cuda") from a ``torch.device`` or its name, without importing torch."""
    return str(dev).partition(":")[0]


def describe(dev: torch.device | str) -> str:
    """``"cpu"`` or ``"cuda:0 (NVIDIA H100 80GB HBM3)"`` (torch is imported only for a CUDA device)."""
    if kind(dev) != "cuda":
        return "cpu"
    import torch

    dev = torch.device(dev)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
