"""What to send and when: seeded arrival schedules, user ids and candidate counts (pure numpy).

Arrival times are float seconds, never rounded to milliseconds: integer-millisecond "Poisson" gaps
turn a 2,000 QPS stream into bursts on a 1 ms grid and hide sub-millisecond queueing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recpipe.config import MAX_NUM_CANDIDATES
from recpipe.errors import UsageError


def poisson_arrivals(rate: float, duration: float, seed: int) -> np.ndarray:
    """Arrival times in [0, duration) seconds of a Poisson process at ``rate``, float64, ascending.

    The process is conditioned on delivering exactly ``round(rate * duration)`` arrivals: n + 1 seeded
    exponential gaps scaled so that they sum to ``duration``. (A Poisson process on [0, T] given N(T) = n
    has exactly this law.) The offered rate is then exact, so any shortfall in the achieved rate is the
    generator's or the server's, not the schedule's luck.
    """
    if rate <= 0 or not math.isfinite(rate):
        raise UsageError(f"rate must be a positive number of queries/s, got {rate}")
    if not (duration > 0 and math.isfinite(duration)):
        raise UsageError(f"duration must be positive and finite, got {duration}")
    n = round(rate * duration)
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n + 1)
    times = np.cumsum(gaps[:n]) * (duration / float(gaps.sum()))
    return times


def open_schedule(rate: float, warmup: float, duration: float, seed: int) -> np.ndarray:
    """Arrival times for an open-loop run: ``round(rate * warmup)`` arrivals in [0, warmup) and exactly
    ``round(rate * duration)`` in [warmup, warmup + duration), each part a conditioned Poisson process
    (see ``poisson_arrivals``), so the measured window holds its exact share however short it is."""
    measured = warmup + poisson_arrivals(rate, duration, seed)
    if warmup <= 0:
        return measured
    return np.concatenate([poisson_arrivals(rate, warmup, seed + 1_000_003), measured])


@dataclass(frozen=True)
class CandidateSpec:
    """How many candidates each query asks for: a fixed number, a lognormal, or a quantile table."""

    kind: str  # "fixed" | "lognormal" | "quantiles"
    fixed: int = 500
    median: float = 0.0
    sigma: float = 0.0
    quantiles: tuple[float, ...] = ()
    values: tuple[float, ...] = ()
    source: str = ""

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(self.fixed)
        if self.kind == "lognormal":
            return f"lognormal:{self.median:g},{self.sigma:g}"
        return f"quantiles:{self.source}"

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` candidate counts, int64 in [1, MAX_NUM_CANDIDATES]."""
        if self.kind == "fixed":
            raw = np.full(n, float(self.fixed))
        elif self.kind == "lognormal":
            raw = rng.lognormal(math.log(self.median), self.sigma, size=n)
        else:
            # Inverse CDF: a uniform draw interpolated through the (quantile, value) table.
            raw = np.interp(rng.random(n), self.quantiles, self.values)
        return np.clip(np.rint(raw), 1, MAX_NUM_CANDIDATES).astype(np.int64)

    def share_below(self, n: int, draws: int = 100_000) -> float:
        """The share of queries that ask for fewer than ``n`` candidates: exact for a fixed count, else
        estimated from ``draws`` seeded samples of the run's own sampler (rounding and clipping included)."""
        if self.kind == "fixed":
            return float(self.fixed < n)
        return float(np.mean(self.sample(np.random.default_rng(0), draws) < n))


def fixed_candidates(n: int) -> CandidateSpec:
    if not 1 <= n <= MAX_NUM_CANDIDATES:
        raise UsageError(f"--num-candidates must be in 1..{MAX_NUM_CANDIDATES}, got {n}")
    return CandidateSpec("fixed", fixed=n)


def parse_lognormal(spec: str) -> CandidateSpec:
    """``lognormal:MEDIAN,SIGMA`` (MEDIAN > 0 candidates, SIGMA >= 0 the log-space spread)."""
    kind, _, params = spec.partition(":")
    parts = params.split(",")
    if kind != "lognormal" or len(parts) != 2:
        raise UsageError(f"--candidates-dist must look like lognormal:MEDIAN,SIGMA, got {spec!r}")
    try:
        median, sigma = float(parts[0]), float(parts[1])
    except ValueError:
        raise UsageError(f"--candidates-dist: MEDIAN and SIGMA must be numbers, got {spec!r}") from None
    if not (median > 0 and sigma >= 0 and math.isfinite(median) and math.isfinite(sigma)):
        raise UsageError(f"--candidates-dist: need MEDIAN > 0 and SIGMA >= 0, got {spec!r}")
    return CandidateSpec("lognormal", median=median, sigma=sigma)


def load_quantile_file(path: str | Path) -> CandidateSpec:
    """Read a candidate-count distribution from a quantile file.

    Format (text, UTF-8): one entry per line; blank lines and ``#`` comments are ignored. Either every
    line is ``QUANTILE VALUE`` (quantile in [0, 1], strictly increasing; values non-decreasing) or every
    line is a single ``VALUE`` (the values are taken as equally spaced quantiles from 0 to 1, e.g. the
    101 percentiles p0..p100). Queries draw u ~ U(0, 1) and take the value interpolated at u (inverse
    CDF); draws below the first / above the last quantile take the first / last value.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--candidates-file: cannot read {p}: {e}") from None
    rows: list[tuple[int, list[float]]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        try:
            nums = [float(x) for x in body.replace(",", " ").split()]
        except ValueError:
            raise UsageError(f"--candidates-file {p}:{lineno}: not a number: {body!r}") from None
        if len(nums) not in (1, 2) or not all(math.isfinite(x) for x in nums):
            raise UsageError(f"--candidates-file {p}:{lineno}: expected 'QUANTILE VALUE' or 'VALUE'")
        rows.append((lineno, nums))
    if len(rows) < 2:
        raise UsageError(f"--candidates-file {p}: need at least 2 entries, found {len(rows)}")
    widths = {len(nums) for _, nums in rows}
    if len(widths) != 1:
        raise UsageError(f"--candidates-file {p}: mixes 'QUANTILE VALUE' and 'VALUE' lines")
    if widths == {2}:
        q = np.array([nums[0] for _, nums in rows])
        v = np.array([nums[1] for _, nums in rows])
        if q[0] < 0 or q[-1] > 1 or np.any(np.diff(q) <= 0):
            raise UsageError(f"--candidates-file {p}: quantiles must be strictly increasing within [0, 1]")
    else:
        v = np.array([nums[0] for _, nums in rows])
        q = np.linspace(0.0, 1.0, len(v))
    if np.any(np.diff(v) < 0):
        raise UsageError(f"--candidates-file {p}: values must be non-decreasing (they are quantiles)")
    if v[0] < 1 or v[-1] > MAX_NUM_CANDIDATES:
        raise UsageError(f"--candidates-file {p}: values must be in 1..{MAX_NUM_CANDIDATES}")
    return CandidateSpec("quantiles", quantiles=tuple(q.tolist()), values=tuple(v.tolist()), source=str(p))


@dataclass(frozen=True)
class UserSpec:
    """Which users queries are for: ``uniform`` over 0..num_users-1 or ``zipf`` with ``exponent``.

    Zipf ranks are mapped to ids through a seeded permutation, so the popular users are not simply the
    smallest ids (which the data generator may lay out specially).
    """

    kind: str  # "uniform" | "zipf"
    num_users: int
    exponent: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "zipf"):
            raise UsageError(f"--users must be uniform or zipf, got {self.kind!r}")
        if self.num_users < 1:
            raise UsageError(f"number of users must be >= 1, got {self.num_users}")
        if not self.exponent > 0:
            raise UsageError(f"--zipf-exponent must be > 0, got {self.exponent}")

    def sampler(self, seed: int) -> _UserSampler:
        return _UserSampler(self, seed)


class _UserSampler:
    def __init__(self, spec: UserSpec, seed: int) -> None:
        self.spec = spec
        if spec.kind == "zipf":
            weights = 1.0 / np.arange(1, spec.num_users + 1, dtype=np.float64) ** spec.exponent
            self._cdf = np.cumsum(weights / weights.sum())
            self._perm = np.random.default_rng([seed, 7]).permutation(spec.num_users)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.spec.kind == "uniform":
            return rng.integers(0, self.spec.num_users, size=n, dtype=np.int64)
        ranks = np.minimum(np.searchsorted(self._cdf, rng.random(n), side="right"), self.spec.num_users - 1)
        return self._perm[ranks].astype(np.int64)


class QueryStream:
    """Query ``i`` -> (user_id, num_candidates), deterministic in ``seed`` and independent of the mode.

    Generated in blocks on demand, so closed-loop runs of unknown length need no up-front size.
    """

    BLOCK = 4096

    def __init__(self, users: UserSpec, candidates: CandidateSpec, seed: int) -> None:
        self._users = users.sampler(seed)
        self._candidates = candidates
        self._seed = seed
        self._user_blocks: list[np.ndarray] = []
        self._cand_blocks: list[np.ndarray] = []

    def _extend(self) -> None:
        rng = np.random.default_rng([self._seed, 1, len(self._user_blocks)])
        self._user_blocks.append(self._users.sample(rng, self.BLOCK))
        self._cand_blocks.append(self._candidates.sample(rng, self.BLOCK))

    def __getitem__(self, i: int) -> tuple[int, int]:
        b, j = divmod(i, self.BLOCK)
        while b >= len(self._user_blocks):
            self._extend()
        return int(self._user_blocks[b][j]), int(self._cand_blocks[b][j])


@dataclass(frozen=True)
class ArrivalIntervals:
    """Recorded inter-arrival times to replay in order (and again from the start when they run out),
    like perf_analyzer's ``--request-intervals``."""

    intervals_s: tuple[float, ...]
    source: str = ""

    @property
    def mean_rate(self) -> float:
        """Queries per second the intervals offer on average."""
        return len(self.intervals_s) / sum(self.intervals_s)

    def schedule(self, warmup: float, duration: float | None, queries: int | None) -> np.ndarray:
        """Arrival times (s): the warm-up's share, then ``queries`` arrivals or those due in
        ``duration`` seconds after it; the first arrival is one interval after the start."""
        gaps = np.asarray(self.intervals_s, dtype=np.float64)
        # Enough whole passes over the file to cover the run, with one to spare.
        horizon_n = (queries or 0) + int(self.mean_rate * (warmup + (duration or 0))) + len(gaps)
        times = np.cumsum(np.resize(gaps, horizon_n + len(gaps)))
        warm = times[times < warmup]
        rest = times[times >= warmup]
        if queries is not None:
            return np.concatenate([warm, rest[:queries]])
        assert duration is not None
        return times[times < warmup + duration]

    def describe(self) -> dict[str, object]:
        return {"file": self.source, "intervals": len(self.intervals_s), "mean_rate": round(self.mean_rate, 3)}


def load_arrivals_file(path: str | Path) -> ArrivalIntervals:
    """Read inter-arrival times, one per line in microseconds (perf_analyzer's unit); blank lines and
    ``#`` comments are ignored; every value must be a finite number > 0."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--arrivals-file: cannot read {p}: {e}") from None
    out: list[float] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        try:
            us = float(body)
        except ValueError:
            raise UsageError(f"--arrivals-file {p}:{lineno}: not a number of microseconds: {body!r}") from None
        if not (math.isfinite(us) and us > 0):
            raise UsageError(f"--arrivals-file {p}:{lineno}: intervals must be > 0 microseconds, got {body}")
        out.append(us / 1e6)
    if not out:
        raise UsageError(f"--arrivals-file {p}: no intervals in it")
    return ArrivalIntervals(tuple(out), str(p))
