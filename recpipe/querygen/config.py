"""The query generator's configuration, built once from the command line and validated here."""

from __future__ import annotations

import math
from dataclasses import dataclass

from recpipe.errors import UsageError
from recpipe.gateway import UPSTREAM
from recpipe.querygen.workload import ArrivalIntervals, CandidateSpec, UserSpec

MODES = ("sequential", "open", "closed")
#: the user-id range used when neither the gateway nor --num-users says
DEFAULT_NUM_USERS = 1000
DEFAULT_DURATION_S = 10.0
DEFAULT_SLO_STEP_S = 5.0
#: --stability-percent: windows tried before giving up (perf_analyzer's --max-trials default)
DEFAULT_MAX_WINDOWS = 10
#: --stability-percent: how many of the last windows must agree
STABLE_WINDOWS = 3
#: --processes auto: as many sender processes as the load needs (``recpipe.querygen.senders.plan``)
AUTO = "auto"
#: --processes: more than this is a typo, not a load generator
MAX_PROCESSES = 64
#: answered queries a p99 should rest on: 1,000 puts 10 beyond it (fewer, and a p99 is the largest of a
#: handful of samples); what --min-queries suggests, and what an SLO step under it is warned about
STEADY_P99_QUERIES = 1000
#: queries one run (an SLO step, a stability window) may plan: its arrival times and every answer's
#: timings are held in memory, so more is a typo (--rate 1e9 grew to 23 GB), not a measurement
MAX_QUERIES = 10_000_000
#: share of queries that may ask for fewer candidates than --num-results (the gateway refuses them,
#: INVALID_ARGUMENT): the error share an SLO step may have (``recpipe.querygen.slo.SloSearch``)
MAX_SHORT_SHARE = 0.01


def parse_processes(text: str, flag: str = "--processes") -> int | str:
    """``"auto"`` or a whole number in 1..MAX_PROCESSES (``UsageError`` naming ``flag`` otherwise)."""
    value = text.strip().lower()
    if value == AUTO:
        return AUTO
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"{flag} must be a whole number or auto, got {text!r}") from None
    if not 1 <= n <= MAX_PROCESSES:
        raise UsageError(f"{flag} must be in 1..{MAX_PROCESSES} (or auto), got {n}")
    return n


@dataclass(frozen=True)
class QuerygenConfig:
    target: str | None
    mode: str
    candidates: CandidateSpec
    rate: float | None = None
    concurrency: int = 1
    duration: float | None = None
    queries: int | None = None
    warmup: float = 0.0
    users: str = "uniform"
    zipf_exponent: float = 1.0
    num_users: int | None = None
    num_results: int = 10
    slo_p99_ms: float | None = None
    seed: int = 0
    timeout: float = 10.0
    connect_timeout: float = 4.0
    per_component: bool = False
    features: str | None = None
    retrieval: str | None = None
    ranking: str | None = None
    arrivals: ArrivalIntervals | None = None
    stability_percent: float | None = None
    stability_percentile: float = 99.0
    max_windows: int = DEFAULT_MAX_WINDOWS
    #: sender processes: a number, or ``AUTO`` (sized per run by ``recpipe.querygen.senders.plan``)
    processes: int | str = 1
    #: open loop: a run (an SLO step, a stability window) lasts until this many queries were scheduled
    #: if its duration holds fewer (MLPerf LoadGen's minimum query count beside its minimum duration)
    min_queries: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"unknown --mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise UsageError(f"--rate must be > 0 queries/s, got {self.rate}")
        if self.arrivals is not None:
            if self.mode != "open":
                raise UsageError("--arrivals-file replays open-loop arrivals: use it with --mode open")
            if self.rate is not None:
                raise UsageError("give --rate or --arrivals-file, not both (the file sets the rate)")
            if self.slo_p99_ms is not None:
                raise UsageError("--slo-p99-ms searches rates: it cannot replay --arrivals-file")
        elif self.mode == "open" and self.rate is None:
            raise UsageError("--mode open needs --rate QPS (or --arrivals-file)")
        if self.mode != "open" and self.rate is not None:
            raise UsageError(f"--rate applies to --mode open only (mode is {self.mode})")
        if self.concurrency < 1:
            raise UsageError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.mode == "sequential" and self.concurrency != 1:
            raise UsageError("--concurrency applies to --mode closed (sequential is one query at a time)")
        if self.duration is not None and self.queries is not None:
            raise UsageError("give --duration or --queries, not both")
        if self.duration is not None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise UsageError(f"--duration must be > 0 seconds (and finite), got {self.duration}")
        if self.queries is not None and not 1 <= self.queries <= MAX_QUERIES:
            raise UsageError(f"--queries must be in 1..{MAX_QUERIES:,} (the most one run plans), got {self.queries:,}")
        if not (self.warmup >= 0 and math.isfinite(self.warmup)):
            raise UsageError(f"--warmup must be >= 0 seconds (and finite), got {self.warmup}")
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0, got {self.seed}")
        # The user-id range may come from the gateway later; validate the rest of the spec now.
        UserSpec(self.users, self.num_users if self.num_users is not None else 1, self.zipf_exponent)
        if self.num_users is not None and self.num_users < 1:
            raise UsageError(f"--num-users must be >= 1, got {self.num_users}")
        if self.num_results < 1:
            raise UsageError(f"--num-results must be >= 1, got {self.num_results}")
        self._check_num_results()
        if self.slo_p99_ms is not None:
            if self.mode != "open":
                raise UsageError("--slo-p99-ms searches open-loop rates: use it with --mode open")
            if not (self.slo_p99_ms > 0 and math.isfinite(self.slo_p99_ms)):
                raise UsageError(f"--slo-p99-ms must be > 0 (and finite), got {self.slo_p99_ms}")
            if self.queries is not None:
                raise UsageError("--slo-p99-ms runs fixed-duration steps: use --duration, not --queries")
        if self.min_queries < 0:
            raise UsageError(f"--min-queries must be >= 0, got {self.min_queries}")
        if self.min_queries and self.mode != "open":
            raise UsageError("--min-queries lengthens open-loop runs: use it with --mode open (closed and "
                             "sequential runs take --queries N)")
        if self.min_queries and self.queries is not None:
            raise UsageError("give --queries or --min-queries, not both (--queries N is exactly N)")
        if self.stability_percent is not None:
            if not (self.stability_percent > 0 and math.isfinite(self.stability_percent)):
                raise UsageError(f"--stability-percent must be > 0, got {self.stability_percent:g}")
            if self.slo_p99_ms is not None:
                raise UsageError("--stability-percent measures one load: not with --slo-p99-ms")
        if not 0 < self.stability_percentile < 100:
            raise UsageError(f"--stability-percentile must be in (0, 100), got {self.stability_percentile:g}")
        if self.max_windows < STABLE_WINDOWS:
            raise UsageError(f"--max-windows must be >= {STABLE_WINDOWS}, got {self.max_windows}")
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise UsageError(f"--timeout must be > 0 seconds (and finite), got {self.timeout}")
        self._check_planned()
        # the same checks whether the value came from the command line or was built in code
        processes = parse_processes(str(self.processes))
        object.__setattr__(self, "processes", processes)  # "Auto" -> AUTO, "2" -> 2
        if processes != AUTO:
            if self.mode == "sequential" and processes != 1:
                raise UsageError(f"--processes {processes} applies to --mode open and closed: sequential "
                                 "sends one query at a time, so it runs in one process (for N at a time: "
                                 "--mode closed --concurrency N)")
            if self.mode == "closed" and int(processes) > self.concurrency:
                raise UsageError(f"--processes {processes} is more than --concurrency {self.concurrency}: "
                                 "each sender process runs at least one of the clients")
        if self.per_component:
            if not all(t or self.target for t in (self.features, self.retrieval, self.ranking)):
                raise UsageError("--per-component needs --features, --retrieval and --ranking (or --target)")
        elif not self.target:
            raise UsageError("--target HOST:PORT is required (the gateway)")

    def _check_num_results(self) -> None:
        """Refuse a --num-results more than the candidates of over ``MAX_SHORT_SHARE`` of the queries ask
        for: the gateway answers such a query INVALID_ARGUMENT, so the run would measure errors. Not
        "more than the fewest candidates a query can draw": a lognormal can draw 1, and would refuse
        --num-results 10 even where one query in a billion draws fewer."""
        spec, n = self.candidates, self.num_results
        if spec.kind == "fixed":
            if n > spec.fixed:
                raise UsageError(f"--num-results {n} is more than the {spec.fixed} candidates per query "
                                 "(--num-candidates): the gateway refuses every such query")
            return
        short = spec.share_below(n)
        if short > MAX_SHORT_SHARE:
            raise UsageError(f"--num-results {n} is more than the candidates {short:.1%} of the queries ask for "
                             f"({spec.describe()}): the gateway refuses those; at most {MAX_SHORT_SHARE:.0%} may")

    def _check_planned(self) -> None:
        """Refuse a run that plans more than ``MAX_QUERIES`` queries (open loop: rate x (warm-up +
        duration)), before anything is allocated: --rate 1e9 --duration 1 once grew to 23 GB."""
        if self.mode != "open":
            return  # closed and sequential plan --queries (bounded above) or a finite duration
        if self.arrivals is not None:
            rate, source = self.arrivals.mean_rate, " (--arrivals-file's mean)"
        else:
            assert self.rate is not None
            rate, source = self.rate, ""
        planned = rate * (self.warmup + (self.window_s(rate) or 0.0))
        if planned > MAX_QUERIES:
            length = f"--queries {self.queries:,}" if self.queries is not None else f"{self.window_s(rate):g} s"
            raise UsageError(f"an open-loop run at {rate:g} q/s{source} over {self.warmup:g} s of warm-up + {length} "
                             f"plans {planned:,.0f} queries; at most {MAX_QUERIES:,} per run")

    @property
    def stage_targets(self) -> dict[str, str]:
        """features / retrieval / ranking addresses for --per-component (each defaults to --target)."""
        return {name: getattr(self, name) or self.target or "" for name in UPSTREAM}

    @property
    def measured_duration(self) -> float | None:
        """Seconds measured after warm-up; open mode turns --queries N into N / rate."""
        if self.duration is not None:
            return self.duration
        if self.queries is not None:
            if self.mode == "open" and self.arrivals is not None:
                return self.queries / self.arrivals.mean_rate
            return self.queries / self.rate if self.mode == "open" and self.rate else None
        return DEFAULT_SLO_STEP_S if self.slo_p99_ms is not None else DEFAULT_DURATION_S

    def window_s(self, rate: float | None) -> float | None:
        """Seconds an open-loop run at ``rate`` (queries/s) measures: ``measured_duration``, lengthened
        where it would schedule fewer than ``min_queries`` queries."""
        planned = self.measured_duration
        if planned is None or not self.min_queries or not rate:
            return planned
        return max(planned, self.min_queries / rate)
