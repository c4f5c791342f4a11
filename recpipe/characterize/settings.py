"""What a characterization was run with: its sizes (quick or full) and every setting, frozen.

Two characterizations compare stage by stage only when they measured the same thing: the same data
(scale, seed), the same query mix and the same run sizes. The platform-side settings (device, threads,
workers, other serve options) are what a comparison varies, so they are recorded but not required to
match.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from recpipe.errors import UsageError
from recpipe.querygen.config import parse_processes
from recpipe.serving.affinity import AFFINITIES


@dataclass(frozen=True)
class Sizes:
    """How much each section measures."""

    sequential_queries: int
    warmup_s: float
    point_s: float
    max_concurrency: int
    sweep_p99_ms: float
    slo_bounds_ms: tuple[float, ...]
    slo_step_s: float
    slo_max_steps: int
    bench_calls: int
    bench_warmup: int
    hop_calls: int
    retrieval_ks: tuple[int, ...]
    ranking_batches: tuple[int, ...]
    #: queries per ranking core call (each of num_candidates candidates)
    ranking_query_batches: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.sequential_queries < 1 or self.max_concurrency < 1 or self.bench_calls < 1:
            raise UsageError("characterize: queries, concurrency and bench calls must be >= 1")
        if not (self.point_s > 0 and self.slo_step_s > 0 and self.sweep_p99_ms > 0 and self.warmup_s >= 0):
            raise UsageError("characterize: durations and bounds must be > 0")
        if self.slo_max_steps < 1:
            raise UsageError("characterize: SLO steps must be >= 1")
        if self.hop_calls < 10:
            raise UsageError("characterize: hop calls must be >= 10")


#: ``--quick``: every section, a few seconds each (CI)
QUICK = Sizes(sequential_queries=40, warmup_s=0.3, point_s=1.0, max_concurrency=4, sweep_p99_ms=500.0,
              slo_bounds_ms=(200.0,), slo_step_s=2.0, slo_max_steps=3, bench_calls=10, bench_warmup=2, hop_calls=50,
              retrieval_ks=(100,), ranking_batches=(100,), ranking_query_batches=(1, 4))
#: the default: minutes in all. The sweep may reach 256 clients: on the H200 machine 11 processes were
#: still rising at 64 (3,209 q/s at p99 31 ms, 78cf8d1), where the old cap stopped the sweep.
FULL = Sizes(sequential_queries=500, warmup_s=2.0, point_s=5.0, max_concurrency=256, sweep_p99_ms=200.0,
             slo_bounds_ms=(10.0, 20.0, 50.0), slo_step_s=5.0, slo_max_steps=10, bench_calls=200, bench_warmup=20, hop_calls=2000,
             retrieval_ks=(100, 500), ranking_batches=(100, 500),
             ranking_query_batches=(1, 2, 4, 8, 16, 32))

#: the sweep stops once doubling the clients gains less than this fraction of throughput
MIN_GAIN = 0.05


@dataclass(frozen=True)
class Settings:
    quick: bool
    sizes: Sizes
    data: str
    models: str
    data_scale: float | None
    data_seed: int | None
    dataset_sha256: str | None
    device: str = "auto"
    threads: str = "auto"
    #: ``--replicas`` as given ("auto", the command's default, sizes them from the cores; "1": one
    #: process per stage, what documents from before the setting were measured with)
    replicas: str = "auto"
    #: ``--affinity`` ("auto": ranking on cores of its own where the processes outnumber the cores; "off":
    #: the kernel places them, what documents from before the setting were measured with)
    affinity: str = "auto"
    workers: int = 0
    serve_args: tuple[str, ...] = ()
    num_candidates: int = 500
    num_results: int = 10
    seed: int = 0
    budget_s: float = 1800.0
    #: querygen --processes for the sweep and the SLO searches (the sequential run uses one)
    generator_processes: int | str = "auto"

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.num_candidates < 1 or self.num_results < 1:
            raise UsageError("--num-candidates and --num-results must be >= 1")
        if self.workers < 0:
            raise UsageError(f"--workers must be >= 0, got {self.workers}")
        if not self.budget_s > 0:
            raise UsageError(f"--budget-s must be > 0, got {self.budget_s:g}")
        parse_processes(str(self.generator_processes), "--generator-processes")
        if self.affinity not in AFFINITIES:
            raise UsageError(f"--affinity must be {' or '.join(AFFINITIES)}, got {self.affinity!r}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["serve_args"] = list(self.serve_args)
        out["sizes"] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.sizes).items()}
        return out


#: settings two characterizations must share for a speed-up between them to mean something
COMPARABLE: tuple[str, ...] = ("quick", "data_scale", "data_seed", "num_candidates", "num_results", "seed", "sizes")
#: settings a rerun into the same --out must share with the finished sections (else they do not belong together)
RESUMABLE: tuple[str, ...] = (*COMPARABLE, "data", "models", "device", "threads", "replicas", "affinity",
                              "workers", "serve_args")
#: what a document written before a setting existed was measured with
_DEFAULTS: dict[str, Any] = {"replicas": "1", "affinity": "off"}


def past_sweep_bound(p99_us: float, bound_ms: float) -> bool:
    """Whether a sweep point's end-to-end p99 passed the sweep's bound: where the sweep stops, and what
    makes two sweep bounds matter to a comparison (``recpipe.characterize.compare``)."""
    return p99_us > bound_ms * 1000


#: a sweep point may fail this share of its queries (the SLO search's allowance, ``SloSearch``); one that
#: fails more stops the sweep, for its failures, whatever its p99
MAX_FAILED_SHARE = 0.01


def failed_reason(clients: int, failed: int, queries: int, by_code: dict[str, int] | None = None) -> str | None:
    """A sweep's stop reason at a point whose failed queries (refused, timed out) passed ``MAX_FAILED_SHARE``
    of its ``queries`` (``stopped_for_failures``); None where they did not."""
    if failed <= 0 or failed <= MAX_FAILED_SHARE * queries:
        return None
    codes = ", ".join(f"{code} {n:,}" for code, n in sorted((by_code or {}).items()) if n)
    return (f"{failed:,} of {queries:,} queries failed at {clients} client{'s' * (clients != 1)}"
            + (f" ({codes})" if codes else "") + f", more than the {MAX_FAILED_SHARE:.0%} a point may fail")


def stopped_for_failures(stop_reason: str) -> bool:
    """Whether a sweep stopped because a point's queries failed (``failed_reason``), not at its p99 bound."""
    return re.fullmatch(r"[\d,]+ of [\d,]+ queries failed at \d+ clients?.*", stop_reason) is not None


def cap_reason(clients: int) -> str:
    """A sweep's stop reason once it has measured its largest number of clients (``reached_cap``)."""
    return f"reached {clients} clients"


def reached_cap(stop_reason: str) -> bool:
    """Whether a sweep stopped at its largest number of clients, not at a knee or the p99 bound: what
    makes two caps matter to a comparison (``recpipe.characterize.compare``)."""
    return re.fullmatch(r"reached \d+ clients", stop_reason) is not None


def value(block: dict[str, Any], key: str) -> Any:
    """Setting ``key`` of a settings block, as it was measured (a key older documents lack: its default then)."""
    return block.get(key, _DEFAULTS.get(key))


def differences(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...] = COMPARABLE) -> list[str]:
    """``"threads 'auto' vs '2'"`` for each of ``keys`` where the settings blocks differ (sizes by field)."""
    out = []
    for key in keys:
        x, y = value(a, key), value(b, key)
        if key == "sizes" and isinstance(x, dict) and isinstance(y, dict):
            out += [f"sizes.{k} {x.get(k)!r} vs {y.get(k)!r}" for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        elif x != y:
            out.append(f"{key} {x!r} vs {y!r}")
    return out
