"""One querygen run from configuration to result document: connect, look up the pipeline, offer load,
summarise. ``execute(config)`` returns the versioned JSON-ready dict that ``--out`` writes."""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
from typing import Any, TextIO

import grpc.aio

from recpipe import __version__
from recpipe.config import STEPS, TOTAL_STEP
from recpipe.errors import UsageError
from recpipe.gateway import STEP_STAGES, UPSTREAM
from recpipe.querygen import clients, loops, platform_info
from recpipe.querygen.config import DEFAULT_NUM_USERS, STABLE_WINDOWS, QuerygenConfig
from recpipe.querygen.output import FORMAT
from recpipe.querygen.progress import Progress
from recpipe.querygen.recorder import Measurement, Recorder, merge
from recpipe.querygen.slo import SloSearch, SloStep, find_max_rate
from recpipe.querygen.workload import QueryStream, UserSpec, open_schedule
from recpipe.stages import REGISTRY

#: The stage clients talk to (the chain's entry).
GATEWAY = REGISTRY.entry.name

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
    """Answered measured queries per second over the measured window.

    The window runs from the end of warm-up to the last answer, but is never shorter than the planned
    duration: a run that keeps up achieves exactly its target rate, one that falls behind less.
    """
    if m.last_done is None or m.queries == 0:
        return 0.0
    window = max(m.last_done - measure_from, planned_s or 0.0)
    return m.queries / window if window > 0 else 0.0


def summarise(m: Measurement) -> dict[str, Any]:
    """The latency part of a run: end_to_end (+ CDF), stages (observed + server), send lag, errors."""
    stages = {}
    for stage in STEPS:
        h = m.stages[stage]
        stages[stage] = {**h.observed.summary(), "server": h.server.summary(), "queue": h.queue.summary(),
                         "compute": h.compute.summary(), "batch_size": h.batch_summary()}
    total = m.stages[TOTAL_STEP]
    lag = m.send_lag.summary()
    lag["late_over_1ms"] = m.late_sends
    lag["late_share"] = round(m.late_sends / lag["count"], 6) if lag["count"] else 0.0
    return {
        "queries": m.queries,
        "ok": m.ok,
        "errors": m.error_count,
        "errors_by_code": dict(sorted(m.errors.items())),
        "warmup_queries": m.warmup_queries,
        "end_to_end": {**m.end_to_end.summary(), "cdf": m.end_to_end.cdf()},
        "pipeline_total": {**total.observed.summary(), "server": total.server.summary()},
        "stages": stages,
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

    async def open(self) -> None:
        cfg = self.config
        targets: dict[str, str] = {}
        if cfg.target:
            targets[GATEWAY] = cfg.target
        if cfg.per_component:
            targets.update(cfg.stage_targets)
        chans: dict[str, grpc.aio.Channel] = {}
        for name, target in targets.items():
            # One channel per distinct address: a single test server may play every role.
            existing = next((chans[n] for n, t in targets.items() if t == target and n in chans), None)
            if existing is None:
                existing = await clients.connect(target, cfg.connect_timeout)
                self.channels.append(existing)
            chans[name] = existing
            self._by_role[name] = existing
            self.pipeline[name] = {"target": target, **((await clients.get_info(existing)) or {})}
        if not cfg.per_component:
            await self._probe_stages()
        self.num_users = _num_users(cfg, self.pipeline)
        users = UserSpec(cfg.users, self.num_users[0], cfg.zipf_exponent)
        queries = QueryStream(users, cfg.candidates, cfg.seed)
        if cfg.per_component:
            features, retrieval, ranking = (chans[name] for name in UPSTREAM)
            self.send = clients.component_send(features, retrieval, ranking,
                                               queries, cfg.num_results, cfg.timeout, targets=targets)
        else:
            self.send = clients.gateway_send(chans[GATEWAY], queries, cfg.num_results, cfg.timeout)

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
        for ch in self.channels:
            await ch.close(None)

    async def measure(self, rate: float | None, label: str = "", warmup: float | None = None,
                      window: int = 0) -> tuple[Measurement, Recorder, float | None]:
        """One run of the configured mode (at ``rate`` for open loop). ``warmup`` overrides the
        configured warm-up (later stability windows need none); ``window`` varies the open loop's seed."""
        cfg = self.config
        assert self.send is not None, "open() first"
        warm = cfg.warmup if warmup is None else warmup
        planned = cfg.measured_duration
        total_queries = cfg.queries if cfg.mode != "open" else None
        progress = Progress(self.stream, label, total_s=(planned or 0) + warm if not total_queries else None,
                            total_queries=total_queries)
        if cfg.mode == "open":
            if cfg.arrivals is not None:
                arrivals = cfg.arrivals.schedule(warm, None if cfg.queries else planned, cfg.queries)
            else:
                assert rate is not None and planned is not None
                arrivals = open_schedule(rate, warm, planned, cfg.seed + window)
            rec = await loops.run_open(self.send, arrivals.tolist(), warm, progress)
        else:
            concurrency = cfg.concurrency if cfg.mode == "closed" else 1
            duration = None if cfg.queries is not None else planned
            rec = await loops.run_closed(self.send, concurrency, warm, duration, cfg.queries, progress)
            planned = None
        return rec.finish(), rec, planned


def agree(values: list[float], percent: float) -> bool:
    """Each value within ``percent`` % of their mean (perf_analyzer's stability test, on one percentile)."""
    mean = sum(values) / len(values)
    if mean <= 0:
        return all(v == 0 for v in values)
    return all(abs(v - mean) / mean * 100 <= percent for v in values)


async def measure_until_stable(session: Session, rate: float | None) -> tuple[Measurement, float, dict[str, Any]]:
    """Repeat measurement windows until the last ``STABLE_WINDOWS`` agree within
    ``--stability-percent`` on the chosen end-to-end percentile, or ``--max-windows`` have run; the
    result merges the last ``STABLE_WINDOWS`` windows. Returns (measurement, achieved rate, report)."""
    cfg = session.config
    assert cfg.stability_percent is not None
    tell = Progress(session.stream)
    pct = cfg.stability_percentile
    windows: list[dict[str, Any]] = []
    parts: list[tuple[Measurement, float]] = []
    stable = False
    for k in range(cfg.max_windows):
        m, rec, planned = await session.measure(
            rate, f"window {k + 1} of at most {cfg.max_windows}", warmup=cfg.warmup if k == 0 else 0.0, window=k)
        achieved = achieved_rate(m, rec.measure_from, planned)
        value = m.end_to_end.percentile_us(pct)
        windows.append({"window": k + 1, "queries": m.queries, "errors": m.error_count,
                        "achieved_rate": round(achieved, 3), "value_us": value,
                        "p50_us": m.end_to_end.percentile_us(50), "p99_us": m.end_to_end.percentile_us(99)})
        parts.append((m, achieved))
        tell.say(f"window {k + 1}: p{pct:g} {value / 1000:.2f} ms, {achieved:.1f} q/s")
        if len(parts) >= STABLE_WINDOWS and agree([w["value_us"] for w in windows[-STABLE_WINDOWS:]],
                                                  cfg.stability_percent):
            stable = True
            break
    last = parts[-STABLE_WINDOWS:]
    merged = merge([p[0] for p in last])
    report = {"percent": cfg.stability_percent, "percentile": pct, "max_windows": cfg.max_windows,
              "stable": stable, "merged_windows": len(last), "windows": windows}
    return merged, sum(a for _, a in last) / len(last), report


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
                               min_rate=MIN_STEP_QUERIES / step_s if step_s else 0.5)
            best: dict[float, tuple[Measurement, float]] = {}

            tell = Progress(session.stream)

            async def step(rate: float) -> SloStep:
                k = len(best) + 1
                m, rec, planned = await session.measure(
                    rate, f"SLO step {k} of at most {search.max_steps}, {rate:.1f} q/s")
                achieved = achieved_rate(m, rec.measure_from, planned)
                best[rate] = (m, achieved)
                s = SloStep(rate, round(achieved, 3), m.end_to_end.percentile_us(50),
                            m.end_to_end.percentile_us(99), m.end_to_end.percentile_us(99.9),
                            m.queries, m.error_count)
                ok = s.meets(search.slo_p99_us, search.max_error_fraction, search.min_rate_fraction)
                tell.say(f"SLO step {k} of at most {search.max_steps}: {rate:.1f} q/s offered, "
                         f"{achieved:.1f} achieved, p99 {s.p99_us / 1000:.2f} ms -> "
                         f"{'meets' if ok else 'misses'} p99 <= {config.slo_p99_ms:g} ms")
                return s

            result = await find_max_rate(search, step)
            slo_json = result.to_json(search, step_s)
            # The headline numbers are those of the best passing step (else the lowest rate tried).
            rate = result.max_rate if result.max_rate is not None else min(best)
            m, achieved = best[rate]
        elif config.stability_percent is not None:
            rate = config.rate if config.arrivals is None else config.arrivals.mean_rate
            m, achieved, stability = await measure_until_stable(session, rate)
        else:
            rate = config.rate if config.arrivals is None else config.arrivals.mean_rate
            m, rec, planned = await session.measure(rate)
            achieved = achieved_rate(m, rec.measure_from, planned)
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
    if stability is not None and not stability["stable"]:
        warnings.append(f"not stable: the last {STABLE_WINDOWS} of {len(stability['windows'])} windows disagree by "
                        f"more than {config.stability_percent:g}% on p{config.stability_percentile:g}; the "
                        "numbers merge them anyway (longer windows or more --max-windows may settle it)")
    if config.mode == "open" and doc["send_lag"]["late_share"] > 0.01:
        warnings.append(f"{doc['send_lag']['late_share'] * 100:.1f}% of queries were sent more than 1 ms late")
    if m.error_count:
        warnings.append(f"{m.error_count} of {m.queries} queries failed: {doc['errors_by_code']}")
    if doc["workload"]["num_users_source"].startswith("default"):
        warnings.append(f"user ids drawn from 0..{DEFAULT_NUM_USERS - 1}: the gateway did not report "
                        f"{NUM_USERS_KEY!r}; pass --num-users")
    return doc
