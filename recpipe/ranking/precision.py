"""The ranking forward's numeric precision on the CPU: fp32, bf16 or int8, and ``auto``.

- ``bf16``: the served forward's weights, embeddings and activations in bfloat16, compiled with
  ``torch.compile`` (dynamic shapes over fixed candidate buckets, all compiled and warmed at load:
  ``recpipe.ranking.predictor``). oneDNN runs the matmuls on AMX / AVX512-BF16; without them bf16 is
  emulated and slower, so it is offered only where ``native_bf16()``. Eager bf16 was barely faster
  than fp32 here (the forward is many small ops); compiled, the ops fuse and it is several times
  faster. fp32 compiled gained ~10%, not worth a compilation at start-up, so fp32 stays eager;
- ``int8``: dynamic quantization of every ``nn.Linear`` of the served forward (int8 weights,
  activations quantized per call; the x86 quantized engine uses VNNI / AMX-INT8 where present); the
  embedding lookups and the interaction stay in float32;
- ``auto``: the fastest of these, timed on this machine at load, among those that keep the bound
  against fp32 (``recpipe.ranking.probe``): no probability moved by more than ``probe.MAX_ABS_DP``
  on the held-out probe rows scored at load, and held-out AUC within ``AUC_BUDGET`` of fp32's (as
  ``recpipe train`` measured it on the served forward, ``metrics.ranking_auc_by_precision`` in the
  manifest, and on the probe). A repository with neither measurement gets fp32.

On a CUDA device the forward stays fp32 (the GPU paths are what they were); asking for another
precision there is a usage error.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from recpipe.errors import UsageError

if TYPE_CHECKING:  # torch is imported where a forward is built, not by the flag's validation
    import torch
    from torch import nn

PRECISIONS = ("auto", "fp32", "bf16", "int8")
#: the precisions a forward can run in (``auto`` picks one of them)
FORMS = ("fp32", "bf16", "int8")
#: ``recpipe serve``'s default (the library's, ``RankingCore``, is fp32: the same scores every time)
SERVE_DEFAULT = "auto"
#: held-out AUC a lower precision may lose against fp32 and still be picked by ``auto``
AUC_BUDGET = 0.002
_FLAGS = ("avx512_bf16", "amx_bf16", "amx_int8", "amx_tile", "avx512_vnni", "avx_vnni", "avx512f", "avx2")


def check(precision: str) -> str:
    """``precision`` if it is one of ``PRECISIONS``, else a UsageError naming the choices."""
    if precision not in PRECISIONS:
        raise UsageError(f"--ranking-precision must be one of {'|'.join(PRECISIONS)}, got {precision!r}")
    return precision


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    """The ISA extensions that matter for the forward, as the kernel reports them (empty if unknown)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return tuple(f for f in _FLAGS if f in have)
    return ()


#: oneDNN's ISA caps (``ONEDNN_MAX_CPU_ISA``) below its first bf16 one: under them bf16 is emulated
_NO_BF16_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI")


def native_bf16(flags: tuple[str, ...] | None = None) -> bool:
    """Whether the CPU computes bf16 matmuls natively (AVX512-BF16 or AMX-BF16), and oneDNN may use
    them: ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) capped below AVX512_CORE_BF16 makes bf16
    emulated, and is how a test run on such a CPU takes an AVX2-only machine's paths."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if cap in _NO_BF16_ISAS:
        return False
    have = cpu_flags() if flags is None else flags
    return "avx512_bf16" in have or "amx_bf16" in have


def describe_isa() -> str:
    """For GetInfo: torch's CPU capability and the relevant cpuinfo flags, e.g. ``AVX512 (avx512_bf16 amx_int8 ...)``."""
    import torch

    flags = cpu_flags()
    return f"{torch.backends.cpu.get_cpu_capability()} ({' '.join(flags) if flags else 'flags unknown'})"


def available(device: torch.device) -> tuple[str, ...]:
    """The forms this device can run: fp32 only on CUDA; bf16 only with native support."""
    if device.type != "cpu":
        return ("fp32",)
    return tuple(f for f in FORMS if f != "bf16" or native_bf16())


def convert(module: nn.Module, form: str, compile: bool = True) -> nn.Module:
    """A copy of ``module`` (its weights untouched) running in ``form``; fp32 returns ``module`` itself.
    bf16 is compiled lazily (at its first call) unless ``compile`` is False."""
    import torch
    from torch import nn

    if form == "fp32":
        return module
    if form == "bf16":
        low = copy.deepcopy(module).to(torch.bfloat16)
        return torch.compile(low, dynamic=True) if compile else low  # type: ignore[return-value]
    if form == "int8":
        from torch.ao.quantization import quantize_dynamic

        # torch.ao's eager quantization is deprecated in favour of torchao, which is not a dependency
        # here (and whose CPU int8 path for small dynamic matmuls is what this already is); still works.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            return quantize_dynamic(copy.deepcopy(module), {nn.Linear}, dtype=torch.qint8)
    raise ValueError(f"no precision form {form!r}")


class Checked(Protocol):
    """A form's check against fp32 at load (``recpipe.ranking.probe.FormCheck``)."""

    @property
    def ok(self) -> bool: ...
    @property
    def auc_delta(self) -> float | None: ...
    def describe(self) -> str: ...


@dataclass(frozen=True)
class Choice:
    form: str
    #: why: the per-form timings, AUC deltas and bound checks that decided it
    reason: str


def choose(requested: str, device: torch.device, auc_by_form: Mapping[str, float] | None,
           timers: Mapping[str, Callable[[], None]], rounds: int = 20,
           checks: Mapping[str, Checked] | None = None) -> Choice:
    """Resolve ``requested`` on ``device``. ``auto`` times each eligible form's ``timers`` entry
    (alternating, ``rounds`` each) and keeps the fastest. A form other than fp32 is eligible when it
    keeps the bound: its ``checks`` entry (the probe scored at load, ``recpipe.ranking.probe``) is ok,
    and the held-out AUC ``recpipe train`` measured for it (``auc_by_form``) is within ``AUC_BUDGET``
    of fp32's; with no AUC measured either way it is not. Each form's time is its fastest round: at
    start-up the machine is often busy (other stages loading), and the minimum is what a form costs
    when nothing interferes (a median picked int8 on a loaded VM where it is the slowest form when
    measured quietly)."""
    forms = available(device)
    checks = checks or {}
    if requested != "auto":
        if requested not in forms:
            why = "a CUDA device runs fp32" if device.type != "cpu" else "this CPU has no native bf16"
            raise UsageError(f"--ranking-precision {requested}: not available here ({why}); choose one of "
                             f"{'|'.join(('auto', *forms))}")
        checked = checks.get(requested)
        return Choice(requested, "requested" + (f"; {checked.describe()}" if checked is not None else ""))
    if len(forms) == 1:
        return Choice("fp32", f"auto: {device.type} runs fp32")
    trained = dict(auc_by_form or {})
    base = trained.get("fp32")
    if base is None and not any(c.auc_delta is not None for c in checks.values()):
        return Choice("fp32", "auto: the repository has no per-precision AUC (trained before it was measured)")
    why_not: dict[str, str] = {}
    for f in forms:
        delta = trained[f] - base if base is not None and f in trained else None
        checked = checks.get(f)
        if f == "fp32":
            continue
        if delta is not None and delta < -AUC_BUDGET:
            why_not[f] = "over the AUC budget"
        elif checked is not None and not checked.ok:
            why_not[f] = f"breaks the bound at load ({checked.describe()})"
        elif delta is None and (checked is None or checked.auc_delta is None):
            why_not[f] = "no AUC measured for it"
    ok = [f for f in forms if f in timers and f not in why_not]
    samples: dict[str, list[float]] = {f: [] for f in ok}
    for f in ok:
        timers[f]()  # warm-up
    for _ in range(rounds):
        for f in ok:
            t0 = time.perf_counter()
            timers[f]()
            samples[f].append(time.perf_counter() - t0)
    ms = {f: min(s) * 1e3 for f, s in samples.items()}
    best = min(ok, key=lambda f: ms[f]) if ok else "fp32"

    def part(f: str) -> str:
        train = f", dAUC {trained[f] - base:+.4f}" if base is not None and f in trained else ""
        at_load = f"; at load {checks[f].describe()}" if f in checks else ""
        return f"{f} {ms[f]:.2f} ms (fastest of {rounds}){train}{at_load}"

    tail = "".join(f"; {f}: {why}" for f, why in why_not.items())
    return Choice(best, f"auto: fastest within the bound ({'; '.join(part(f) for f in ok)}){tail}")
