"""SLO search: the highest open-loop rate whose end-to-end p99 stays under a bound.

Bracket first (double the rate while it passes, halve it while it fails), then bisect between the
highest passing and the lowest failing rate until they are within ``tolerance`` of each other. Each
step is one fixed-length open-loop run (``measure``); every step is kept, so the result is the whole
rate-latency curve, not just its knee.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recpipe.querygen.recorder import Measurement


@dataclass(frozen=True)
class SloStep:
    target_rate: float
    achieved_rate: float
    p50_us: float
    p99_us: float
    p999_us: float
    queries: int
    errors: int

    @classmethod
    def of(cls, rate: float, achieved: float, m: Measurement) -> SloStep:
        """The step at ``rate`` offered from its measurement: its percentiles over every query, a failed
        one counted until its deadline at least (``Measurement.every_query``), so that a rate whose slow
        queries time out, or that sheds its load fast, is no faster for it."""
        every = m.every_query()
        return cls(rate, round(achieved, 3), every.percentile_us(50), every.percentile_us(99),
                   every.percentile_us(99.9), m.queries, m.error_count)

    def meets(self, slo_p99_us: float, max_error_fraction: float, min_rate_fraction: float) -> bool:
        """Under the p99 bound, few enough errors, and the rate was actually delivered."""
        if self.queries == 0:
            return False
        return (self.p99_us <= slo_p99_us
                and self.errors <= max_error_fraction * self.queries
                and self.achieved_rate >= min_rate_fraction * self.target_rate)


@dataclass(frozen=True)
class SloSearch:
    slo_p99_us: float
    start_rate: float
    tolerance: float = 0.05
    max_steps: int = 12
    min_rate: float = 0.5
    max_error_fraction: float = 0.01
    #: a step whose achieved rate falls this far below its target overloaded something (server or
    #: generator), whatever its p99 says
    min_rate_fraction: float = 0.95
    #: the highest rate a step may offer (its queries are planned in memory: ``config.MAX_QUERIES``)
    max_rate: float = math.inf


@dataclass(frozen=True)
class SloResult:
    max_rate: float | None
    curve: list[dict[str, float | int | bool]]

    def to_json(self, search: SloSearch, step_seconds: float) -> dict[str, object]:
        return {"slo_p99_us": search.slo_p99_us, "slo_p99_ms": search.slo_p99_us / 1000,
                "max_rate": self.max_rate, "step_duration_s": step_seconds, "tolerance": search.tolerance,
                "curve": self.curve}


async def find_max_rate(search: SloSearch, measure: Callable[[float], Awaitable[SloStep]]) -> SloResult:
    """Run the search; ``measure(rate)`` performs one step. ``max_rate`` is None if no rate passed."""
    passing: float | None = None
    failing: float | None = None
    curve: list[dict[str, float | int | bool]] = []
    rate = search.start_rate

    async def step(r: float) -> bool:
        s = await measure(r)
        ok = s.meets(search.slo_p99_us, search.max_error_fraction, search.min_rate_fraction)
        curve.append({**asdict(s), "meets_slo": ok})
        return ok

    while len(curve) < search.max_steps:
        if await step(rate):
            passing = rate
            if failing is not None or rate >= search.max_rate:
                break
            rate = min(rate * 2, search.max_rate)
        else:
            failing = rate
            if passing is not None:
                break
            rate /= 2
            if rate < search.min_rate:
                break
    while (passing is not None and failing is not None and len(curve) < search.max_steps
           and failing / passing - 1 > search.tolerance):
        mid = (passing + failing) / 2
        if await step(mid):
            passing = mid
        else:
            failing = mid
    curve.sort(key=lambda c: float(c["target_rate"]))
    return SloResult(passing, curve)


def knee(max_rate: float | None, curve: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The two steps of a search's ``curve`` either side of its knee: the one at ``max_rate`` (the highest
    that met the bound) and the lowest-rate one above it that missed; None where that side has none."""
    met = next((c for c in curve if max_rate is not None and c["target_rate"] == max_rate), None)
    missed = [c for c in curve if not c["meets_slo"] and (max_rate is None or c["target_rate"] > max_rate)]
    return met, min(missed, key=lambda c: c["target_rate"]) if missed else None
