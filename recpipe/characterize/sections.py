"""The sections of a characterization, each a function returning its JSON block.

The serving sections (sequential, sweep, slo) share one chain of stage processes started the way
``recpipe demo`` starts it, and measure through ``recpipe.querygen.session.execute``; CPU time is read
from the supervised stage processes (and this process, the generator) around each measurement, and the
CPU time of the stages' own core calls from their GetInfo (``recpipe.serving.inline.COMPUTE_CPU_KEY``),
so each stage's CPU per query splits into its computing and the serving around it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from recpipe import cputime
from recpipe.accel.traffic import KEY as TRAFFIC_KEY
from recpipe.accel.traffic import Traffic
from recpipe.characterize import cpu_probe, datapaths, document, micro, ranking_batches
from recpipe.characterize.gpu import BusySampler
from recpipe.characterize.settings import MIN_GAIN, Settings, cap_reason, failed_reason, past_sweep_bound
from recpipe.config import STEPS
from recpipe.querygen import slo
from recpipe.querygen.compare import block
from recpipe.querygen.session import MIN_STEP_QUERIES
from recpipe.serving.inline import COMPUTE_CPU_KEY
from recpipe.serving.threads import usable_cores

#: the generator's own CPU time is recorded beside the stages' under this name
GENERATOR = "querygen"


def say(message: str) -> None:
    print(f"== characterize: {message}", file=sys.stderr, flush=True)


def platform_section(settings: Settings) -> dict[str, Any]:
    """The generator's machine (CPU, cores, memory, GPU, driver, libraries), and how fast its CPU ran
    fixed work as the characterization started (``cpu_probe``)."""
    from recpipe.querygen import platform_info

    out = platform_info.detect()
    out["memory_bytes"] = _mem_total()
    out["usable_cores"] = usable_cores()
    out["gpus"] = _gpus()
    try:
        import torch

        out["torch_cuda"] = {"available": bool(torch.cuda.is_available()), "cuda": torch.version.cuda,
                             "threads": torch.get_num_threads()}
    except ImportError:
        out["torch_cuda"] = {"available": False}
    out["cpu_probe"] = cpu_probe.probe()
    return out


def _mem_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpus() -> list[dict[str, str]]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
    return [{"name": r[0], "memory": r[1], "driver": r[2]} for r in rows if len(r) == 3]


@dataclass(frozen=True)
class Chain:
    gateway: str
    #: per stage, its processes' pids (one per replica)
    pids: dict[str, list[int | None]]
    #: per stage, the address of each of its processes
    addresses: dict[str, list[str]]

    def cpu(self) -> dict[str, float | None]:
        """CPU seconds per stage (its replicas together) and of this process."""
        return cputime.snapshot({**self.pids, GENERATOR: [os.getpid()]})

    def counters(self) -> Counters:
        """What each stage reports of itself in GetInfo so far, its replicas added up (``Counters``)."""
        from recpipe.querygen import loops

        return loops.run(_counters(self.addresses))


@dataclass(frozen=True)
class Counters:
    """Per stage, its running counts from GetInfo ``details``, its replicas added up: ``traffic``, what
    it copied between host and device (``recpipe.accel.traffic``), for the stages that report it;
    ``compute_s``, the CPU seconds of its core calls (None where a replica did not say: the gateway,
    which has no core, or a stage from before the count)."""

    traffic: dict[str, Traffic | None]
    compute_s: dict[str, float | None]


async def _counters(addresses: dict[str, list[str]]) -> Counters:
    from recpipe.errors import UsageError
    from recpipe.querygen import clients

    traffic: dict[str, Traffic | None] = {}
    compute: dict[str, float | None] = {}
    for name, targets in addresses.items():
        for i, target in enumerate(targets):  # a stage's replicas each count their own
            details: dict[str, str] = {}
            try:
                channel = await clients.connect(target)
            except UsageError:
                channel = None
            if channel is not None:
                try:
                    details = (await clients.get_info(channel) or {}).get("details") or {}
                finally:
                    await channel.close(None)
            if (text := details.get(TRAFFIC_KEY)) is not None:
                traffic[name] = _plus(traffic.get(name), Traffic.parse(text))
            spent, so_far = _seconds(details.get(COMPUTE_CPU_KEY)), compute.get(name)
            compute[name] = spent if i == 0 else None if spent is None or so_far is None else so_far + spent
    return Counters(traffic, compute)


def _seconds(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def _plus(a: Traffic | None, b: Traffic | None) -> Traffic | None:
    if a is None or b is None:
        return b if a is None else a
    return Traffic(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(Traffic)})


@contextlib.contextmanager
def chain(settings: Settings, log_level: str) -> Iterator[Chain]:
    """The stages (one process each, or the replicas ``settings.replicas`` asks for) on free ports of
    127.0.0.1, as ``recpipe demo`` starts them."""
    from recpipe.config import DEFAULT_HOST
    from recpipe.serving.launch import direct_target, plan_chain, threads_arg
    from recpipe.serving.supervisor import Supervisor
    from recpipe.stages import REGISTRY

    host = DEFAULT_HOST
    planned = plan_chain(REGISTRY, models=Path(settings.models), data=Path(settings.data), host=host,
                         replicas=settings.replicas, threads=threads_arg(settings.threads), affinity=settings.affinity,
                         device=settings.device, workers=settings.workers, log_level=log_level,
                         extra=settings.serve_args)
    stages = planned.processes
    say(f"serve: starting {', '.join(REGISTRY.names)}; {'; '.join(planned.said)}")
    supervisor = Supervisor(stages)
    supervisor.start()
    try:
        own = {spec.name: spec.address for spec in stages}
        processes = supervisor.replicas()
        pids = {stage: [supervisor.pid(p) for p in names] for stage, names in processes.items()}
        addresses = {stage: [own[p] for p in names] for stage, names in processes.items()}
        # this one process generates the load: it calls each gateway replica directly, per call
        yield Chain(direct_target(stages, REGISTRY.entry.name), pids, addresses)
    finally:
        supervisor.stop()


def _config(settings: Settings, target: str, **kw: Any) -> Any:
    from recpipe.querygen.config import QuerygenConfig
    from recpipe.querygen.workload import fixed_candidates

    # the generator's processes (querygen --processes) for the loads: sequential is one query at a time,
    # and the sweep's closed loop has at least a client per process
    processes = 1 if kw.get("mode") == "sequential" else settings.generator_processes
    if kw.get("mode") == "closed" and isinstance(processes, int):
        processes = min(processes, kw.get("concurrency", 1))
    return QuerygenConfig(target=target, candidates=fixed_candidates(settings.num_candidates),
                          num_results=settings.num_results, seed=settings.seed, warmup=settings.sizes.warmup_s,
                          processes=processes, **kw)


@dataclass(frozen=True)
class Measured:
    """One querygen run (``doc``) and what it cost: ``cpu``, the CPU seconds per answered query of each
    process group (the warm-up's queries and CPU included; ``document.COUNTS``); ``load`` (``_load``);
    ``compute``, the CPU seconds per answered query of each stage's own core calls (``Counters.compute_s``);
    and the stages' counters before and after."""

    doc: dict[str, Any]
    cpu: dict[str, float | None]
    load: dict[str, Any]
    compute: dict[str, float | None]
    before: Counters
    after: Counters


def _measure(ch: Chain, config: Any) -> Measured:
    """One querygen run and what it cost (``Measured``)."""
    from recpipe.querygen import loops, session

    counters0 = ch.counters()
    before, machine0, t0 = ch.cpu(), cputime.machine_ticks(), time.monotonic()
    doc = loops.run(session.execute(config))
    after, machine1, wall = ch.cpu(), cputime.machine_ticks(), time.monotonic() - t0
    counters1 = ch.counters()
    answered = doc["ok"] + doc["warmup_queries"]  # document.COUNTS: a refused query is no query served
    after = _with_senders(after, doc["generator"]["sender_cpu_s"])
    return Measured(doc, cputime.per_query(before, after, answered),
                    _load(ch, doc, before, after, machine0, machine1, wall),
                    _compute_per_query(counters0, counters1, answered), counters0, counters1)


def _compute_per_query(before: Counters, after: Counters, queries: int) -> dict[str, float | None]:
    """Per stage that reports it, its core calls' CPU seconds per query between two readings (None
    where a reading is missing or went back: a replica restarted)."""
    known = {k: v for k, v in before.compute_s.items() if v is not None or after.compute_s.get(k) is not None}
    return cputime.per_query(known, after.compute_s, queries)


def _load(ch: Chain, doc: dict[str, Any], before: dict[str, float | None], after: dict[str, float | None],
          machine0: cputime.MachineTicks | None, machine1: cputime.MachineTicks | None, wall: float) -> dict[str, Any]:
    """How busy the run kept the machine and each process group: ``machine_busy``, the share of all cores
    busy (/proc/stat; None where unreadable); ``cores``, the CPU seconds per second of each stage (its
    replicas together) and of the generator (its sender processes too); ``processes``, how many
    processes each of those is. A group whose cores per process near 1 is capped by its one event-loop
    thread, whatever the machine has left."""
    share = machine0.busy_share(machine1) if machine0 is not None and machine1 is not None else None
    cores: dict[str, float | None] = {}
    for name, b in before.items():
        a = after.get(name)
        cores[name] = None if a is None or b is None or a < b or wall <= 0 else round((a - b) / wall, 3)
    processes = {name: len(pids) for name, pids in ch.pids.items()}
    # the parent runs the senders (querygen --processes N) and sends nothing itself
    processes[GENERATOR] = max(1, int(doc["generator"].get("processes") or 1))
    return {"machine_busy": None if share is None else round(share, 3), "cores": cores, "processes": processes}


def _with_senders(after: dict[str, float | None], sender_cpu_s: float) -> dict[str, float | None]:
    """The generator's CPU time including its sender processes' (querygen --processes N > 1)."""
    mine = after.get(GENERATOR)
    return {**after, GENERATOR: None if mine is None else mine + sender_cpu_s}


def _stage_block(stage: dict[str, Any]) -> dict[str, Any]:
    return {"p50_us": stage["p50_us"], "p99_us": stage["p99_us"], "mean_us": stage["mean_us"],
            "count": stage["count"], "server": _pcts(stage["server"]), "queue": _pcts(stage["queue"]),
            "compute": _pcts(stage["compute"]), "batch_size": stage.get("batch_size")}


def _pcts(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in ("p50_us", "p99_us", "mean_us", "count")}


def sequential_section(settings: Settings, ch: Chain) -> dict[str, Any]:
    """The sequential run, with what the stages copied between host and device per query (from their
    GetInfo before and after: ``recpipe.accel.traffic``)."""
    config = _config(settings, ch.gateway, mode="sequential", queries=settings.sizes.sequential_queries)
    m = _measure(ch, config)
    doc = m.doc
    transfers = datapaths.per_query(m.before.traffic, m.after.traffic, doc["queries"] + doc["warmup_queries"])
    return {
        "queries": doc["queries"], "errors": doc["errors"], "achieved_rate": doc["achieved_rate"],
        "end_to_end": doc["end_to_end"], "end_to_end_all": block(doc, "end_to_end"), "pipeline_total": _pcts(doc["pipeline_total"]),
        "stages": {s: _stage_block(doc["stages"][s]) for s in STEPS},
        "cpu_s_per_query": m.cpu, "compute_cpu_s_per_query": m.compute, "load": m.load,
        "transfers_per_query": transfers, "pipeline": doc["pipeline"],
        "model_version": doc["model_version"], "warnings": doc["warnings"], "attribution": doc["attribution"],
        "counts": dict(document.COUNTS),
    }


def sweep_section(settings: Settings, ch: Chain, time_left: Callable[[], float],
                  busy: BusySampler | None = None) -> dict[str, Any]:
    """Closed loop at 1, 2, 4, ... clients until throughput stops rising, p99 passes the bound, more than
    ``MAX_FAILED_SHARE`` of a point's queries fail (refused, timed out), the largest concurrency is reached
    or the budget is spent. With ``busy`` (the section's GPU sampler),
    each point's GPU busy fraction too (``gpu_busy``: its samples during that point), so the peak's is
    known."""
    s = settings.sizes
    points: list[dict[str, Any]] = []
    stop = cap_reason(s.max_concurrency)
    best = 0.0
    c = 1
    while c <= s.max_concurrency:
        if time_left() <= 0:
            stop = "budget spent"
            break
        say(f"sweep: {c} client{'s' * (c != 1)} for {s.point_s:g} s")
        mark = busy.mark() if busy is not None else 0
        m = _measure(ch, _config(settings, ch.gateway, mode="closed", concurrency=c, duration=s.point_s))
        doc = m.doc
        e2e = block(doc, "end_to_end")  # every query: a point whose slow queries time out must not pass the bound
        points.append({"concurrency": c, "throughput": doc["achieved_rate"], "queries": doc["queries"],
                       "errors": doc["errors"], "p50_us": e2e["p50_us"], "p99_us": e2e["p99_us"],
                       "stages": {st: {"p50_us": doc["stages"][st]["p50_us"], "p99_us": doc["stages"][st]["p99_us"]}
                                  for st in STEPS},
                       "cpu_s_per_query": m.cpu, "compute_cpu_s_per_query": m.compute, "load": m.load,
                       "gpu_busy": busy.fraction_since(mark) if busy is not None else None,
                       "attribution": doc["attribution"]})
        say(f"sweep: {c} clients -> {doc['achieved_rate']:.1f} q/s, p99 {e2e['p99_us'] / 1000:.2f} ms")
        if failed := failed_reason(c, int(doc["errors"]), int(doc["queries"]), doc.get("errors_by_code")):
            stop = failed
            break
        if past_sweep_bound(e2e["p99_us"], s.sweep_p99_ms):
            stop = f"p99 {e2e['p99_us'] / 1000:.2f} ms passed the {s.sweep_p99_ms:g} ms bound"
            if doc["errors"]:  # a few, each counted until its deadline at least
                stop += f" ({doc['errors']:,} of {doc['queries']:,} queries failed)"
            break
        if c > 1 and doc["achieved_rate"] < best * (1 + MIN_GAIN):
            stop = f"throughput rose less than {MIN_GAIN:.0%} over the best so far"
            break
        best = max(best, doc["achieved_rate"])
        c *= 2
    peak = max(points, key=lambda p: p["throughput"]) if points else None
    return {"points": points, "stop_reason": stop, "min_gain": MIN_GAIN, "p99_bound_ms": s.sweep_p99_ms,
            "peak_throughput": peak["throughput"] if peak else None,
            "peak_concurrency": peak["concurrency"] if peak else None,
            "peak_gpu_busy": peak.get("gpu_busy") if peak else None, "counts": dict(document.COUNTS)}


def slo_section(settings: Settings, ch: Chain, start_rate: float | None,
                time_left: Callable[[], float]) -> dict[str, Any]:
    """querygen's SLO search (``recpipe.querygen.slo``: the highest open-loop rate whose p99 stays
    under the bound) for each bound, at most ``sizes.slo_max_steps`` steps each."""
    from recpipe.querygen import loops

    s = settings.sizes
    # querygen's search tries no rate whose step would hold fewer than MIN_STEP_QUERIES queries;
    # it starts near half the sweep's peak and halves or doubles from there.
    start = max(round((start_rate or 20.0) * 0.5, 1), MIN_STEP_QUERIES / s.slo_step_s)
    searches = []
    skipped = []
    for bound in s.slo_bounds_ms:
        if time_left() <= 0:
            skipped.append(bound)
            continue
        say(f"slo: p99 <= {bound:g} ms, starting at {start:g} q/s, {s.slo_step_s:g} s steps, "
            f"at most {s.slo_max_steps}")
        config = _config(settings, ch.gateway, mode="open", rate=start, duration=s.slo_step_s, slo_p99_ms=bound)
        before = ch.cpu()
        result, answered, sender_cpu_s, bands = loops.run(_search(config, bound, start, s.slo_max_steps))
        cpu = cputime.per_query(before, _with_senders(ch.cpu(), sender_cpu_s), answered)
        searches.append({"p99_bound_ms": bound, "max_rate": result.max_rate, "curve": result.curve,
                         "step_duration_s": s.slo_step_s, "cpu_s_per_query": cpu,
                         **_knee_attribution(result.max_rate, result.curve, bands)})
        rate = result.max_rate
        say(f"slo: p99 <= {bound:g} ms -> " + (f"{rate:.1f} q/s" if rate else "no rate met it"))
    return {"start_rate": start, "searches": searches, "skipped_for_budget_ms": skipped, "counts": dict(document.COUNTS)}


def _knee_attribution(max_rate: float | None, curve: list[dict[str, Any]],
                      bands: dict[float, dict[str, Any]]) -> dict[str, Any]:
    """``knee``: where the queries' time went (querygen's ``attribution``) at the highest rate that met
    the bound (``met``) and at the lowest rate above it that did not (``missed``), each as {rate,
    attribution}; None where that side has no step."""
    met, missed = slo.knee(max_rate, curve)
    return {"knee": {side: None if step is None else {"rate": step["target_rate"], "attribution": bands.get(step["target_rate"])}
                     for side, step in (("met", met), ("missed", missed))}}


async def _search(config: Any, bound_ms: float, start: float,
                  max_steps: int) -> tuple[Any, int, float, dict[float, dict[str, Any]]]:
    """One SLO search over a querygen session; returns the result, the queries answered (warm-ups too:
    what its CPU per query divides over, ``document.COUNTS``), the CPU seconds of the generator's sender
    processes (0 with one) and each step's ``attribution`` by its offered rate."""
    from recpipe.querygen.session import Session
    from recpipe.querygen.slo import SloSearch, SloStep, find_max_rate

    session = Session(config)
    search = SloSearch(bound_ms * 1000, start, max_steps=max_steps, min_rate=MIN_STEP_QUERIES / config.duration)
    answered = 0
    sender_cpu_s = 0.0
    bands: dict[float, dict[str, Any]] = {}
    await session.open()
    try:
        async def step(rate: float) -> SloStep:
            nonlocal answered, sender_cpu_s
            measured = await session.measure(rate, f"SLO p99 <= {bound_ms:g} ms, {rate:.1f} q/s")
            m, achieved = measured.measurement, measured.achieved
            bands[rate] = m.split.bands()
            answered += m.ok + m.warmup_queries
            sender_cpu_s += measured.sender_cpu_s
            s = SloStep.of(rate, achieved, m)
            say(f"slo: {rate:.1f} q/s offered, {achieved:.1f} achieved, p99 {s.p99_us / 1000:.2f} ms")
            return s

        return await find_max_rate(search, step), answered, sender_cpu_s, bands
    finally:
        await session.close()


def micro_section(settings: Settings, time_left: Callable[[], float]) -> dict[str, Any]:
    results = []
    skipped = []
    for bench in micro.plan(settings):
        if time_left() <= 0:
            skipped.append(bench.name)
            continue
        say(f"micro: {bench.name}")
        r = micro.run_one(bench)
        if r["error"]:
            say(f"micro: {bench.name} failed: {r['error']}")
        results.append(r)
    if time_left() <= 0:
        skipped.append(ranking_batches.NAME)
    else:
        say(f"micro: {ranking_batches.NAME} {settings.sizes.ranking_query_batches} x {settings.num_candidates}")
        results.append(ranking_batches.run(settings))
        if results[-1]["error"]:
            say(f"micro: {ranking_batches.NAME} failed: {results[-1]['error']}")
    return {"benches": results, "skipped_for_budget": skipped}


def data_paths_section(settings: Settings) -> dict[str, Any]:
    """The data paths between CPU and GPU (``recpipe.characterize.datapaths``), in this process on the
    stages' GPU; recorded as skipped, with the reason, on a CPU run or without a GPU, and as failed
    (measured false, the error as the reason) when the device work raises."""
    from recpipe.characterize import cuda_timer

    why_not = cuda_timer.unavailable(settings.device)
    if why_not:
        say(f"data paths: skipped ({why_not})")
        return datapaths.skipped(why_not)
    plan = datapaths.plan_for(settings.quick)
    try:
        tables = datapaths.tables_of(Path(settings.models))
        say(f"data paths: copies {datapaths.fmt_bytes(min(plan.copy_bytes))} to "
            f"{datapaths.fmt_bytes(max(plan.copy_bytes))}, gathers at {tables.ranking_dim} and "
            f"{tables.retrieval_dim} dims, {plan.repeats} repeats each")
        with cuda_timer.CudaTimer(plan, settings.device) as timer:
            return datapaths.measure(plan, tables, timer)
    except Exception as e:  # one failing section must not lose the others' results
        say(f"data paths: failed: {type(e).__name__}: {e}")
        return {**datapaths.skipped(f"failed: {type(e).__name__}: {e}"), "error": True}
