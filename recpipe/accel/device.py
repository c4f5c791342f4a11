"""Resolve a ``--device auto|cpu|cuda[:N]`` flag to a ``torch.device`` and a human description."""

from __future__ import annotations

from typing import TYPE_CHECKING

from recpipe.errors import UsageError

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


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


def describe(dev: torch.device) -> str:
    """``"cpu"`` or ``"cuda:0 (NVIDIA H100 80GB HBM3)"``."""
    import torch

    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return "cpu"
