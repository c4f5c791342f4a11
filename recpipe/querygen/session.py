"""One querygen run from configuration to result document: connect, look up the pipeline, offer load,
summarise. ``execute(config)`` returns the versioned JSON-ready dict that ``--out`` writes."""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import grpc.aio

from recpipe import __version__, cputime
from recpipe.config import STEPS, TOTAL_STEP
from recpipe.errors import UsageError
from recpipe.gateway import STEP_STAGES, UPSTREAM
from recpipe.querygen import clients, loops, platform_info, senders
from recpipe.querygen.config import (
    DEFAULT_NUM_USERS,
    MAX_QUERIES,
    STABLE_WINDOWS,
    STEADY_P99_QUERIES,
    QuerygenConfig,
)
from recpipe.querygen.output import FORMAT
from recpipe.querygen.progress import Progress
from recpipe.querygen.recorder import Measurement, merge
from recpipe.querygen.slo import SloSearch, SloStep, find_max_rate
from recpipe.querygen.workload import open_schedule
from recpipe.serving.threads import usable_cores

#: The stage clients talk to (the chain's entry).
GATEWAY = clients.GATEWAY_ROLE

FORMAT_VERSION = 1
#: GetInfo detail key giving the user-id range 0..n-1: read from the gateway, else from the features
#: service (reached directly with --per-component, or at the address in the gateway's details["features"])
NUM_USERS_KEY = "num_users"
#: send lag p99 above this means the generator, not the server, limited the offered load
LAG_WARN_US = 1000.0
_PROBE_TIMEOUT_S = 1.0
#: fewest queries an SLO step should hold for its p99 to mean something
MIN_STEP_QUERIES = 100


def _now_utc() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _num_users(config: QuerygenConfig, pipeline: dict[str, Any]) -> tuple[int, str]:
    if config.num_users is not None:
        return config.num_users, "--num-users"
    for name in (GATEWAY, STEP_STAGES["augment_user"]):
        info = pipeline.get(name) or {}
        value = (info.get("details") or {}).get(NUM_USERS_KEY)
        if value is not None:
            try:
                n = int(value)
            except ValueError:
                continue
            if n >= 1:
                return n, f"{name} GetInfo details[{NUM_USERS_KEY!r}]"
    return DEFAULT_NUM_USERS, "default (no --num-users and no GetInfo num_users)"


def achieved_rate(m: Measurement, measure_from: float, planned_s: float | None) -> float:
    """Answered measured queries per second over the measured window (a failed query is not one: a
    server that sheds or times out half its load achieves half the rate, however fast it says no).

    The window runs from the end of warm-up to the last answer, but is never shorter than the planned
    duration: a run that keeps up achieves exactly its target rate, one that falls behind less.
    """
    if m.last_done is None or m.queries == 0:
        return 0.0
    window = max(m.last_done - measure_from, planned_s or 0.0)
    return m.ok / window if window > 0 else 0.0


@dataclass
class Step:
    """One measured run of the configured mode: the merged measurement, its planned length (open loop),
    and what each sender process measured (one entry, this process, when there is one sender)."""

    measurement: Measurement
    planned: float | None
    senders: list[senders.SenderResult]
    #: why this many sender processes (``senders.plan``)
    processes_reason: str
    #: the whole machine's CPU time when the step began and ended (None where /proc/stat is unreadable)
    machine: tuple[cputime.MachineTicks, cputime.MachineTicks] | None = None

    @property
    def achieved(self) -> float:
        return achieved_rate(self.measurement, self.measurement.measure_from, self.planned)

    @property
    def sender_cpu_s(self) -> float:
        """CPU seconds spent by sender processes other than this one (0 with one sender)."""
        if len(self.senders) < 2:
            return 0.0
        return sum(r.cpu_s or 0.0 for r in self.senders)


def _lag_block(m: Measurement) -> dict[str, Any]:
    lag = m.send_lag.summary()
    lag["late_over_1ms"] = m.late_sends
    lag["late_share"] = round(m.late_sends / lag["count"], 6) if lag["count"] else 0.0
    return lag


def generator_block(config: QuerygenConfig, steps: list[Step]) -> dict[str, Any]:
    """How the load was offered: the sender processes and each one's send lag, queries and CPU, over
    ``steps`` (the run, the merged stability windows, or the SLO search's headline step)."""
    n = max(len(s.senders) for s in steps)
    rows = []
    for k in range(n):
        parts = [s.senders[k] for s in steps if k < len(s.senders)]
        m = merge([r.measurement for r in parts])
        cpu = [r.cpu_s for r in parts]
        spent = None if any(c is None for c in cpu) else round(sum(c or 0.0 for c in cpu), 6)
        sent = m.queries + m.warmup_queries
        lag = _lag_block(m)
        rows.append({"process": k, "queries": m.queries, "warmup_queries": m.warmup_queries,
                     "send_lag": {key: lag[key] for key in ("count", "p50_us", "p99_us", "max_us", "late_over_1ms",
                                                            "late_share")},
                     "cpu_s": spent,
                     "cpu_us_per_query": round(spent / sent * 1e6, 1) if spent is not None and sent else None})
    return {"processes": n, "processes_requested": config.processes, "processes_reason": steps[-1].processes_reason,
            "usable_cores": usable_cores(), "senders": rows,
            "sender_cpu_s": round(sum(s.sender_cpu_s for s in steps), 6), "machine_busy": machine_busy(steps)}


def machine_busy(steps: list[Step]) -> float | None:
    """The share of all the machine's cores that was busy over ``steps`` (warm-ups included), whoever
    kept them busy: this generator, a chain on the same machine, other jobs; None where unreadable."""
    spans = [s.machine for s in steps if s.machine is not None]
    if not spans or len(spans) < len(steps):
        return None
    busy = sum(b.busy - a.busy for a, b in spans)
    total = sum(b.total - a.total for a, b in spans)
    return round(busy / total, 3) if total > 0 else None


def summarise(m: Measurement) -> dict[str, Any]:
    """The latency part of a run: end_to_end (+ CDF), stages (observed + server), attribution (the
    median's and the slowest 1%'s time by stage: ``recpipe.querygen.attribution``), send lag, errors."""
    stages = {}
    for stage in STEPS:
        h = m.stages[stage]
        stages[stage] = {**h.observed.summary(), "server": h.server.summary(), "queue": h.queue.summary(),
                         "compute": h.compute.summary(), "batch_size": h.batch_summary()}
    total = m.stages[TOTAL_STEP]
    lag = _lag_block(m)
    return {
        "queries": m.queries,
        "ok": m.ok,
        "errors": m.error_count,
        "errors_by_code": dict(sorted(m.errors.items())),
        "warmup_queries": m.warmup_queries,
        "end_to_end": {**m.end_to_end.summary(), "cdf": m.end_to_end.cdf()},
        # the failed queries to their failure, and every query (answered or failed): end_to_end and the
        # stages hold the answered ones only, which a deadline's failures would leave looking fast
        "failed": m.failed.summary(),
        "end_to_end_all": {**(every := m.every_query()).summary(), "cdf": every.cdf()},
        "pipeline_total": {**total.observed.summary(), "server": total.server.summary()},
        "stages": stages,
        "attribution": m.split.bands(),
        "send_lag": lag,
    }


class Session:
    """Holds the channels and the query stream for one run (or the steps of one SLO search)."""

    def __init__(self, config: QuerygenConfig, stream: TextIO | None = None) -> None:
        self.config = config
        self.stream = stream if stream is not None else sys.stderr
        self.channels: list[grpc.aio.Channel] = []
        self._by_role: dict[str, grpc.aio.Channel] = {}
        self.pipeline: dict[str, Any] = {}
        self.send: loops.Send | None = None
        self.num_users = (0, "")
        self._pool: senders.SenderPool | None = None

    async def open(self) -> None:
        cfg = self.config
        targets = clients.roles(cfg)
        self._by_role, self.channels = await clients.open_roles(targets, cfg.connect_timeout)
        for name, target in targets.items():
            self.pipeline[name] = {"target": target, **((await clients.get_info(self._by_role[name])) or {})}
        if not cfg.per_component:
            await self._probe_stages()
        self.num_users = _num_users(cfg, self.pipeline)
        self.send = clients.send_for(cfg, self._by_role, self.num_users[0])

    async def _probe_stages(self) -> None:
        """Record the stages behind the gateway (device, model version, num_users) when the gateway's
        GetInfo details name their addresses and they are reachable from here; silently skip if not
        (e.g. container-internal names)."""
        details = (self.pipeline.get(GATEWAY) or {}).get("details") or {}

        async def probe(name: str, target: str) -> None:
            try:
                channel = await clients.connect(target, _PROBE_TIMEOUT_S)
            except UsageError:
                return
            try:
                info = await clients.get_info(channel, _PROBE_TIMEOUT_S)
            finally:
                await channel.close(None)
            if info is not None:
                self.pipeline[name] = {"target": target, **info}

        await asyncio.gather(*(probe(name, details[name]) for name in UPSTREAM
                               if details.get(name) and name not in self.pipeline))

    async def refresh_info(self) -> None:
        """Ask again where the first answer lacked a model version (a gateway learns it from its
        stages' first replies)."""
        for name, channel in self._by_role.items():
            if not self.pipeline.get(name, {}).get("model_version"):
                info = await clients.get_info(channel)
                if info is not None:
                    self.pipeline[name].update(info)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for ch in self.channels:
            await ch.close(None)

    def _schedule(self, rate: float | None, warm: float, planned: float | None, window: int) -> Any:
        cfg = self.config
        if cfg.arrivals is not None:
            return cfg.arrivals.schedule(warm, None if cfg.queries else planned, cfg.queries)
        assert rate is not None and planned is not None
        return open_schedule(rate, warm, planned, cfg.seed + window)

    async def measure(self, rate: float | None, label: str = "", warmup: float | None = None,
                      window: int = 0) -> Step:
        """One run of the configured mode (at ``rate`` for open loop). ``warmup`` overrides the
        configured warm-up (later stability windows need none); ``window`` varies the open loop's seed.
        With more than one sender process (``--processes``) the load is split among them
        (``recpipe.querygen.senders``) and their measurements merged."""
        cfg = self.config
        assert self.send is not None, "open() first"
        warm = cfg.warmup if warmup is None else warmup
        offered = cfg.arrivals.mean_rate if cfg.arrivals is not None else rate
        planned = cfg.window_s(offered)  # measured_duration, unless --min-queries (open loop only) lengthens it
        total_queries = cfg.queries if cfg.mode != "open" else None
        n, why = senders.plan(cfg.processes, cfg.mode, offered, cfg.concurrency, usable_cores())
        concurrency = cfg.concurrency if cfg.mode == "closed" else 1

        def span(start: cputime.MachineTicks | None) -> tuple[cputime.MachineTicks, cputime.MachineTicks] | None:
            end = cputime.machine_ticks()
            return None if start is None or end is None else (start, end)

        if n > 1:
            if self._pool is None:
                self._pool = senders.SenderPool(cfg, self.num_users[0])
            await self._pool.grow(n)
            start = cputime.machine_ticks()  # once the senders are up: starting them is not the run's load
            if cfg.mode == "open":
                arrivals = self._schedule(rate, warm, planned, window)
                jobs = [senders.open_job(arrivals, warm, k, n) for k in range(n)]
            else:
                duration = None if cfg.queries is not None else planned
                jobs = [senders.closed_job(concurrency, warm, duration, cfg.queries, k, n) for k in range(n)]
                planned = None
            results = await self._pool.measure(jobs)
            return Step(merge([r.measurement for r in results]), planned, results, why, span(start))
        progress = Progress(self.stream, label, total_s=(planned or 0) + warm if not total_queries else None,
                            total_queries=total_queries)
        before, start = senders.cpu_s(), cputime.machine_ticks()
        if cfg.mode == "open":
            arrivals = self._schedule(rate, warm, planned, window)
            rec = await loops.run_open(self.send, arrivals.tolist(), warm, progress)
        else:
            duration = None if cfg.queries is not None else planned
            rec = await loops.run_closed(self.send, concurrency, warm, duration, cfg.queries, progress)
            planned = None
        m = rec.finish(cfg.timeout)
        return Step(m, planned, [senders.SenderResult(0, m, round(senders.cpu_s() - before, 6))], why, span(start))


def agree(values: list[float], percent: float) -> bool:
    """Each value within ``percent`` % of their mean (perf_analyzer's stability test, on one percentile)."""
    mean = sum(values) / len(values)
    if mean <= 0:
        return all(v == 0 for v in values)
    return all(abs(v - mean) / mean * 100 <= percent for v in values)


async def measure_until_stable(session: Session, rate: float | None
                               ) -> tuple[Measurement, float, dict[str, Any], list[Step]]:
    """Repeat measurement windows until the last ``STABLE_WINDOWS`` agree within
    ``--stability-percent`` on the chosen end-to-end percentile, or ``--max-windows`` have run; the
    result merges the last ``STABLE_WINDOWS`` windows. Returns (measurement, achieved rate, report,
    the merged windows)."""
    cfg = session.config
    assert cfg.stability_percent is not None
    tell = Progress(session.stream)
    pct = cfg.stability_percentile
    windows: list[dict[str, Any]] = []
    parts: list[Step] = []
    stable = False
    for k in range(cfg.max_windows):
        step = await session.measure(
            rate, f"window {k + 1} of at most {cfg.max_windows}", warmup=cfg.warmup if k == 0 else 0.0, window=k)
        m, achieved = step.measurement, step.achieved
        every = m.every_query()  # a window whose slow queries time out must not look stable and fast
        value = every.percentile_us(pct)
        windows.append({"window": k + 1, "queries": m.queries, "errors": m.error_count,
                        "achieved_rate": round(achieved, 3), "value_us": value,
                        "p50_us": every.percentile_us(50), "p99_us": every.percentile_us(99)})
        parts.append(step)
        tell.say(f"window {k + 1}: p{pct:g} {value / 1000:.2f} ms, {achieved:.1f} q/s")
        if len(parts) >= STABLE_WINDOWS and agree([w["value_us"] for w in windows[-STABLE_WINDOWS:]],
                                                  cfg.stability_percent):
            stable = True
            break
    last = parts[-STABLE_WINDOWS:]
    merged = merge([p.measurement for p in last])
    report = {"percent": cfg.stability_percent, "percentile": pct, "max_windows": cfg.max_windows,
              "stable": stable, "merged_windows": len(last), "windows": windows}
    return merged, sum(p.achieved for p in last) / len(last), report, last


def _describe(config: QuerygenConfig, session: Session) -> dict[str, Any]:
    return {
        "users": config.users,
        "zipf_exponent": config.zipf_exponent if config.users == "zipf" else None,
        "num_users": session.num_users[0],
        "num_users_source": session.num_users[1],
        "candidates": config.candidates.describe(),
        "num_results": config.num_results,
        "seed": config.seed,
        "warmup_s": config.warmup,
        "duration_s": config.measured_duration if config.queries is None or config.mode == "open" else None,
        "queries_requested": config.queries,
        "min_queries": config.min_queries,
        "timeout_s": config.timeout,
        "arrivals": config.arrivals.describe() if config.arrivals is not None else None,
    }


async def execute(config: QuerygenConfig, stream: TextIO | None = None) -> dict[str, Any]:
    """Run querygen as configured and return the result document (see ``FORMAT_VERSION``)."""
    session = Session(config, stream)
    started = _now_utc()
    try:
        await session.open()
        slo_json: dict[str, Any] | None = None
        stability: dict[str, Any] | None = None
        rate: float | None
        if config.slo_p99_ms is not None:
            assert config.rate is not None
            step_s = config.measured_duration or 0.0
            # Below MIN_STEP_QUERIES per step a p99 is just the largest of a handful of samples.
            search = SloSearch(config.slo_p99_ms * 1000, config.rate,
                               min_rate=MIN_STEP_QUERIES / step_s if step_s else 0.5,
                               max_rate=MAX_QUERIES / (config.warmup + step_s))
            best: dict[float, Step] = {}

            tell = Progress(session.stream)

            async def step(rate: float) -> SloStep:
                k = len(best) + 1
                measured = await session.measure(
                    rate, f"SLO step {k} of at most {search.max_steps}, {rate:.1f} q/s")
                m, achieved = measured.measurement, measured.achieved
                best[rate] = measured
                s = SloStep.of(rate, achieved, m)
                ok = s.meets(search.slo_p99_us, search.max_error_fraction, search.min_rate_fraction)
                tell.say(f"SLO step {k} of at most {search.max_steps}: {rate:.1f} q/s offered, "
                         f"{achieved:.1f} achieved, p99 {s.p99_us / 1000:.2f} ms -> "
                         f"{'meets' if ok else 'misses'} p99 <= {config.slo_p99_ms:g} ms")
                return s

            result = await find_max_rate(search, step)
            slo_json = result.to_json(search, step_s)
            slo_json["min_queries"] = config.min_queries
            # The headline numbers are those of the best passing step (else the lowest rate tried).
            rate = result.max_rate if result.max_rate is not None else min(best)
            steps = [best[rate]]
            m, achieved = steps[0].measurement, steps[0].achieved
        elif config.stability_percent is not None:
            rate = config.rate if config.arrivals is None else config.arrivals.mean_rate
            m, achieved, stability, steps = await measure_until_stable(session, rate)
        else:
            rate = config.rate if config.arrivals is None else config.arrivals.mean_rate
            steps = [await session.measure(rate)]
            m, achieved = steps[0].measurement, steps[0].achieved
        await session.refresh_info()
    finally:
        await session.close()

    doc: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "recpipe_version": __version__,
        "started_utc": started,
        "finished_utc": _now_utc(),
        "mode": config.mode,
        "per_component": config.per_component,
        "target": config.target,
        "concurrency": config.concurrency if config.mode == "closed" else 1 if config.mode == "sequential" else None,
        "target_rate": rate if config.mode == "open" else None,
        "achieved_rate": round(achieved, 3),
        **summarise(m),
        "generator": generator_block(config, steps),
        "workload": _describe(config, session),
        "platform": platform_info.detect(),
        "pipeline": session.pipeline,
        "model_version": next((i.get("model_version") for i in session.pipeline.values()
                               if i.get("model_version")), None),
        "warnings": [],
    }
    if slo_json is not None:
        doc["slo"] = slo_json
    if stability is not None:
        doc["stability"] = stability
    warnings: list[str] = doc["warnings"]
    if config.mode == "open" and doc["send_lag"]["p99_us"] > LAG_WARN_US:
        warnings.append(
            f"generator fell behind: send lag p99 {doc['send_lag']['p99_us'] / 1000:.2f} ms, max "
            f"{doc['send_lag']['max_us'] / 1000:.2f} ms (latencies still count from the scheduled send time)")
    if config.mode == "open" and rate and achieved < 0.95 * rate:
        warnings.append(f"achieved {achieved:.1f} of {rate:.1f} q/s: the server (or the generator) could "
                        "not keep up")
    if slo_json is not None and slo_json["max_rate"] is None:
        warnings.append(f"no rate met p99 <= {config.slo_p99_ms:g} ms down to "
                        f"{min(c['target_rate'] for c in slo_json['curve']):.2f} q/s (steps under "
                        f"{MIN_STEP_QUERIES} queries are not tried: a longer --duration reaches lower rates)")
    if slo_json is not None:
        few = [c for c in slo_json["curve"] if c["queries"] < STEADY_P99_QUERIES]
        if few:
            warnings.append(f"{len(few)} of {len(slo_json['curve'])} SLO steps answered fewer than "
                            f"{STEADY_P99_QUERIES:,} queries (the fewest {min(c['queries'] for c in few)}): their p99s "
                            f"rest on under {STEADY_P99_QUERIES // 100} queries beyond them, so noise can pass or "
                            f"fail a step; --min-queries {STEADY_P99_QUERIES} runs each step until it has sent that many")
    if stability is not None and not stability["stable"]:
        warnings.append(f"not stable: the last {STABLE_WINDOWS} of {len(stability['windows'])} windows disagree by "
                        f"more than {config.stability_percent:g}% on p{config.stability_percentile:g}; the "
                        "numbers merge them anyway (longer windows or more --max-windows may settle it)")
    gen = doc["generator"]
    behind = [s for s in gen["senders"] if s["send_lag"]["p99_us"] > LAG_WARN_US]
    if config.mode == "open" and gen["processes"] > 1 and behind:
        warnings.append("sender process" + "es" * (len(behind) > 1) + " fell behind: " + ", ".join(
            f"{s['process']} (send lag p99 {s['send_lag']['p99_us'] / 1000:.2f} ms)" for s in behind))
    if gen["machine_busy"] is not None and gen["machine_busy"] >= cputime.SATURATED:
        warnings.append(f"the machine was {gen['machine_busy']:.0%} busy (all cores) during the run: the generator "
                        "shared saturated cores with whatever runs here (the chain, if it does), so the latencies "
                        "include waiting for a CPU; a generator on another machine measures the chain alone")
    if gen["processes"] > gen["usable_cores"]:
        warnings.append(f"{gen['processes']} sender processes on {gen['usable_cores']} usable cores: they compete "
                        "with each other (and with anything else here) for CPU")
    if config.mode == "open" and doc["send_lag"]["late_share"] > 0.01:
        warnings.append(f"{doc['send_lag']['late_share'] * 100:.1f}% of queries were sent more than 1 ms late")
    if m.error_count:
        warnings.append(f"{m.error_count} of {m.queries} queries failed: {doc['errors_by_code']}")
        every, answered = doc["end_to_end_all"], doc["end_to_end"]
        if every["p99_us"] > answered["p99_us"] or every["max_us"] > answered["max_us"]:
            warnings.append(
                f"the end-to-end latencies are of the {m.ok} answered queries; counting the {m.error_count} failed "
                f"ones as unanswered until their deadline or their failure, whichever came later (up to "
                f"{doc['failed']['max_us'] / 1000:.2f} ms), p99 is "
                f"{every['p99_us'] / 1000:.2f} ms (answered: {answered['p99_us'] / 1000:.2f}) and max "
                f"{every['max_us'] / 1000:.2f} ms (end_to_end_all)")
    if doc["workload"]["num_users_source"].startswith("default"):
        warnings.append(f"user ids drawn from 0..{DEFAULT_NUM_USERS - 1}: the gateway did not report "
                        f"{NUM_USERS_KEY!r}; pass --num-users")
    return doc
