"""The report of one characterization: Markdown tables and PNG charts in DIR/report/.

- ``curve.png``: the closed-loop throughput/latency curve (end-to-end p50 and p99 against throughput,
  each point labelled with its clients);
- ``stages.png``: the per-stage stack (p50 of each stage, sequential and at each sweep point);
- ``split.png``: where each stage's time goes in the sequential run: queue, compute, the rest of the
  server's time, and the network (time the gateway saw minus the server's own), means in ms.
The Markdown adds the platform, the settings, the SLO searches, CPU seconds per query per process (and
how much of each stage's its own core calls took), the micro-benchmark rows and the data paths between
CPU and GPU (copy bandwidth, small-copy latency, gathers from host and GPU memory, the placement advice,
and each stage's copies per query and the time they take on those paths). Rewritten on every run (the
directory is the command's own output).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recpipe.characterize import cpu_probe, datapaths, document, load
from recpipe.config import STEPS
from recpipe.gateway import STEP_STAGES
from recpipe.querygen.compare import block
from recpipe.querygen.config import STEADY_P99_QUERIES
from recpipe.querygen.output import write_atomic
from recpipe.querygen.plots import _COLORS, _figure, _save, plain_log_axis
from recpipe.querygen.slo import knee
from recpipe.querygen.table import min_samples, supported

MARKDOWN = "report.md"
CHARTS = ("curve.png", "stages.png", "split.png")


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:.3f}" if us < 1000 else f"{us / 1000:.2f}"


def split(stage: dict[str, Any]) -> dict[str, float]:
    """Mean µs of one stage's time: queue, compute, other server time, network (observed - server)."""
    server = stage["server"]["mean_us"]
    queue, compute = stage["queue"]["mean_us"], stage["compute"]["mean_us"]
    return {"queue": queue, "compute": compute, "other server": max(server - queue - compute, 0.0),
            "network": max(stage["mean_us"] - server, 0.0)}


def title(doc: dict[str, Any]) -> str:
    plat = doc["sections"].get("platform") or {}
    s = doc["settings"]
    return (f"{plat.get('cpu', '?')} ({plat.get('usable_cores', '?')} cores), GPU {plat.get('gpu', '?')}; "
            f"device {s['device']}, threads {s['threads']}{', quick' if s['quick'] else ''}")


def curve_figure(runs: list[tuple[str, dict[str, Any]]]) -> Any:
    """End-to-end p50 and p99 against throughput per sweep point, on a log latency axis (a point whose failed
    queries count until their deadline sits 1,000x above the others), with each sweep's p99 bound drawn;
    a p99 from under 100 queries (the slowest of them) is ringed, a point with failed queries crossed."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    values: list[float] = []
    bounds: dict[float, None] = {}
    few_label = failed_label = ""
    counts: list[tuple[str, float, float, str]] = []  # each point's clients, placed once the axes are laid out
    for i, (label, doc) in enumerate(runs):
        sweep = doc["sections"].get("sweep") or {}
        points = sweep.get("points") or []
        if not points:
            continue
        x = [p["throughput"] for p in points]
        color = f"C{i}"
        prefix = f"{label}: " if len(runs) > 1 else ""
        ax.plot(x, [p["p50_us"] / 1000 for p in points], "o-", color=color, label=f"{prefix}p50")
        ax.plot(x, [p["p99_us"] / 1000 for p in points], "s--", color=color, label=f"{prefix}p99")
        values += [v / 1000 for p in points for v in (p["p50_us"], p["p99_us"]) if v > 0]
        if sweep.get("p99_bound_ms"):
            bounds[float(sweep["p99_bound_ms"])] = None
        for p in points:
            counts.append((f"{p['concurrency']}", p["throughput"], p["p99_us"] / 1000, color))
            if not supported(99.0, int(p.get("queries") or 0)):
                ax.plot(p["throughput"], p["p99_us"] / 1000, "o", markersize=12, markerfacecolor="none",
                        markeredgecolor="black", label=few_label or "p99 from < 100 queries (not supported)")
                few_label = "_"
            if p.get("errors"):
                ax.plot(p["throughput"], p["p99_us"] / 1000, "x", markersize=10, color="red",
                        label=failed_label or "point with failed queries (each counted until its deadline)")
                failed_label = "_"
    for bound in bounds:
        ax.axhline(bound, color="red", alpha=0.5, linestyle=":", label=f"sweep's p99 bound: {bound:g} ms")
    if values:
        plain_log_axis(ax, "y", min(values), max(values), extra=bounds)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.5)  # room above the highest point for its client count
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no sweep points", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("throughput (answered queries/s)")
    ax.set_ylabel("end-to-end latency (ms, log scale)")
    ax.grid(alpha=0.3)
    ax.set_title("closed-loop concurrency sweep (numbers: clients)", fontsize=10)
    fig.suptitle(title(runs[0][1]) if len(runs) == 1 else "characterizations compared", fontsize=9)
    _label_points(ax, counts)
    return fig


#: a point's label moves up this many points at a time, at most ``_LABEL_STEPS`` times, while it would overlap
#: one already placed (two runs' 1- and 2-client points sit close together)
_LABEL_STEP = 9
_LABEL_STEPS = 4


def _label_points(ax: Any, labels: list[tuple[str, float, float, str]]) -> None:
    """Write each (text, x, y, color) up-left of its point, clear of its line, and, where it would overlap a
    label already written, higher, a step at a time (``_LABEL_STEP``), so that no two overlap."""
    renderer = ax.figure.canvas.get_renderer()
    ax.figure.canvas.draw()  # the constrained layout places the axes: the labels are measured where they go
    placed: list[Any] = []
    for text, x, y, color in labels:
        for k in range(_LABEL_STEPS + 1):
            note = ax.annotate(text, (x, y), textcoords="offset points", xytext=(-6, 6 + _LABEL_STEP * k), ha="right",
                               fontsize=8, color=color)
            box = note.get_window_extent(renderer)
            if k == _LABEL_STEPS or not any(box.overlaps(b) for b in placed):
                placed.append(box)
                break
            note.remove()


def stages_figure(doc: dict[str, Any]) -> Any:
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    columns: list[tuple[str, dict[str, Any]]] = []
    if seq := doc["sections"].get("sequential"):
        columns.append(("sequential", seq["stages"]))
    for p in (doc["sections"].get("sweep") or {}).get("points") or []:
        columns.append((clients(p["concurrency"]), p["stages"]))
    names = [c[0] for c in columns]
    bottom = [0.0] * len(columns)
    for stage in STEPS:
        values = [c[1][stage]["p50_us"] / 1000 for c in columns]
        ax.bar(names, values, bottom=bottom, color=_COLORS[stage], label=stage)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if not columns:
        ax.text(0.5, 0.5, "no serving section finished", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.set_ylim(top=max(bottom) * 1.35)  # room for the legend above the bars
        ax.legend(fontsize=8, ncols=2)
        if len(columns) > 8:  # a sweep to 256 clients: ten labels would run into each other
            ax.tick_params(axis="x", labelrotation=30)
    ax.set_ylabel("per-stage p50, stacked (ms)")
    ax.set_xlabel("run")
    ax.set_title("per-stage latency stack (p50 of each stage as the gateway saw it)", fontsize=10)
    fig.suptitle(title(doc), fontsize=9)
    return fig


_SPLIT_COLORS = {"queue": "#8172B3", "compute": "#C44E52", "other server": "#CCB974", "network": "#64B5CD"}


def split_figure(doc: dict[str, Any]) -> Any:
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    seq = doc["sections"].get("sequential")
    if not seq:
        ax.text(0.5, 0.5, "sequential section not run", ha="center", va="center", transform=ax.transAxes)
    else:
        parts = {stage: split(seq["stages"][stage]) for stage in STEPS}
        left = [0.0] * len(STEPS)
        for part, color in _SPLIT_COLORS.items():
            values = [parts[s][part] / 1000 for s in STEPS]
            ax.barh(list(STEPS), values, left=left, color=color,
                    label="network (observed - server)" if part == "network" else part)
            left = [a + v for a, v in zip(left, values, strict=True)]
        ax.invert_yaxis()
        ax.legend(fontsize=8)
    ax.set_xlabel("mean time per query (ms)")
    ax.set_ylabel("stage")
    ax.set_title("where the time goes, sequential: queue vs compute vs network", fontsize=10)
    fig.suptitle(title(doc), fontsize=9)
    return fig


def markdown(doc: dict[str, Any], charts: tuple[str, ...] = CHARTS) -> str:
    sec = doc["sections"]
    s = doc["settings"]
    out = ["# recpipe characterization", "", f"{title(doc)}; recpipe {doc['recpipe_version']}, "
           f"started {doc['started_utc']}, updated {doc['updated_utc']}", ""]
    if left := not_run(doc):
        out += ["**Not run or cut short:** " + "; ".join(f"{k} ({v})" for k, v in left.items()), ""]
    if plat := sec.get("platform"):
        mem = plat.get("memory_bytes")
        gpus = ", ".join(f"{g['name']} {g['memory']} driver {g['driver']}" for g in plat.get("gpus") or []) or "none"
        libs = ", ".join(f"{k} {v}" for k, v in (plat.get("libraries") or {}).items())
        out += ["## Platform", "", f"- CPU: {plat['cpu']}, {plat['cores']} cores ({plat['usable_cores']} usable)",
                f"- memory: {mem / 2**30:.1f} GiB" if mem else "- memory: ?", f"- GPU: {gpus}",
                f"- CPU probe: {cpu_probe.describe(plat.get('cpu_probe'))}",
                f"- OS: {plat['os']}, Python {plat['python']}", f"- libraries: {libs}", ""]
    out += ["## Settings", "", "| setting | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in s.items() if k != "sizes"]
    out += [f"| sizes.{k} | {v} |" for k, v in s["sizes"].items()] + [""]
    if seq := sec.get("sequential"):
        devices = ", ".join(f"{n}: {i.get('device')}" for n, i in seq["pipeline"].items() if isinstance(i, dict))
        out += ["## Sequential per-stage latency", "",
                f"{seq['queries']} queries ({seq['errors']} errors), {seq['achieved_rate']:.1f} q/s; devices {devices}",
                "", "| stage | p50 ms | p99 ms | server p50 ms | queue mean ms | compute mean ms | network mean ms |",
                "|---|---|---|---|---|---|---|"]
        for stage in STEPS:
            b = seq["stages"][stage]
            parts = split(b)
            out.append(f"| {stage} | {_ms(b['p50_us'])} | {_ms(b['p99_us'])}{p99_mark(b.get('count'))} | "
                       f"{_ms(b['server']['p50_us'])} | {_ms(parts['queue'])} | {_ms(parts['compute'])} | "
                       f"{_ms(parts['network'])} |")
        e = block(seq, "end_to_end")  # every query, a failed one until its deadline at least
        out += [f"| **end to end** | {_ms(e['p50_us'])} | {_ms(e['p99_us'])}{p99_mark(e.get('count'))} | | | | |", ""]
        if note := p99_note([b.get("count") for b in (*seq["stages"].values(), e)]):
            out += [note, ""]
        out += _tail_line("Sequential", seq.get("attribution"))
        out += _cpu_table(f"CPU seconds per {cpu_per(doc, 'sequential')} (ms of CPU) per process, sequential:",
                          seq["cpu_s_per_query"])
        if own := own_work_of("Sequential", seq, seq):
            out += [own, ""]
        out += _gpu_line(seq)
    if sweep := sec.get("sweep"):
        out += ["## Closed-loop concurrency sweep", "", f"Stopped: {sweep['stop_reason']}. Peak "
                f"{sweep['peak_throughput'] or 0:.1f} q/s at {sweep['peak_concurrency']} clients.", ""]
        procs = list((sweep["points"][0]["cpu_s_per_query"] if sweep["points"] else {}).keys())
        # a document from before the runs recorded their load has no machine column
        loaded = any((p.get("load") or {}).get("machine_busy") is not None for p in sweep["points"])
        out += ["| clients | q/s | p50 ms | p99 ms | " + " | ".join(f"{st} p50/p99 ms" for st in STEPS) + " | "
                + " | ".join(f"CPU ms/q {p}" for p in procs) + (" | machine busy |" if loaded else " |"),
                "|---" * (4 + len(STEPS) + len(procs) + loaded) + "|"]
        p99_counts: list[int | None] = []  # the queries of each p99 in the table
        for p in sweep["points"]:
            answered = int(p["queries"]) - int(p.get("errors") or 0)  # the stages' p99s are of the answered queries only
            p99_counts += [p["queries"], answered]
            cells = [str(p["concurrency"]), f"{p['throughput']:.1f}", _ms(p["p50_us"]),
                     _ms(p["p99_us"]) + p99_mark(p["queries"])]
            cells += [f"{_ms(p['stages'][st]['p50_us'])} / {_ms(p['stages'][st]['p99_us'])}{p99_mark(answered)}"
                      for st in STEPS]
            cells += [_cpu_ms(p["cpu_s_per_query"].get(q)) for q in procs]
            busy = (p.get("load") or {}).get("machine_busy")
            if loaded:
                cells.append("-" if busy is None else f"{busy:.0%}")
            out.append("| " + " | ".join(cells) + " |")
        out += ["", f"CPU ms/q: each process group's ms of CPU per {cpu_per(doc, 'sweep')}, the warm-up's too."]
        if note := p99_note(p99_counts):
            out += ["", note]
        if failed := failures(doc, "sweep", [(clients(p["concurrency"]), p) for p in sweep["points"]]):
            out += ["", f"**Failed queries:** {failed}"]
        peak = next((p for p in sweep["points"] if p["concurrency"] == sweep["peak_concurrency"]), None)
        out += ["", *_tail_line(f"At the sweep's peak ({sweep['peak_concurrency']} clients)",
                                peak.get("attribution") if peak else None), *_gpu_line(sweep)]
        if peak is not None and (what := load.describe(peak.get("load"), peak.get("gpu_busy"))):
            out += [f"What the peak kept busy: {what}", ""]
        if peak is not None and (own := own_work_of(f"At the peak ({sweep['peak_concurrency']} clients)", peak, seq)):
            out += [own, ""]
    if slo := sec.get("slo"):
        out += ["## SLO search (highest open-loop rate with end-to-end p99 under the bound)", "",
                "| p99 bound ms | max rate q/s | steps | queries at the knee (met / missed) |", "|---|---|---|---|"]
        thin = False
        for srch in slo["searches"]:
            rate = srch["max_rate"]
            counts = _knee_queries(srch)
            thin = thin or any(n is not None and n < STEADY_P99_QUERIES for n in counts)
            out.append(f"| {srch['p99_bound_ms']:g} | {'none met' if rate is None else f'{rate:.1f}'} | "
                       f"{len(srch['curve'])} | {' / '.join('-' if n is None else str(n) for n in counts)} |")
        for srch in slo["searches"]:
            if failed := failures(doc, "slo", [(f"{st['target_rate']:.1f} q/s", st) for st in srch["curve"]]):
                out.append(f"\n**p99 <= {srch['p99_bound_ms']:g} ms, failed queries:** {failed}")
        peak_rate = (sec.get("sweep") or {}).get("peak_throughput")
        out += [line for srch in slo["searches"] if (line := unmet_line(srch, seq, peak_rate))]
        if slo.get("skipped_for_budget_ms"):
            out.append(f"\nNot searched (budget): {slo['skipped_for_budget_ms']}")
        if thin:
            out.append(f"\nA knee step under {STEADY_P99_QUERIES:,} queries rests its p99 on fewer than "
                       f"{STEADY_P99_QUERIES // 100} queries beyond it: one or two slow queries can move that rate by a step.")
        out += [""]
        for srch in slo["searches"]:
            knee, bound = srch.get("knee") or {}, f"p99 <= {srch['p99_bound_ms']:g} ms"
            for side, what in (("met", "the highest that met it"), ("missed", "the lowest above it that missed")):
                if step := knee.get(side):
                    out += _tail_line(f"{bound}, at {step['rate']:.1f} q/s ({what})", step["attribution"])
    if micro := sec.get("micro"):
        out += ["## Micro-benchmarks", "", "| bench | form | p50 ms | p99 ms | p50 ms per query |", "|---|---|---|---|---|"]
        for b in micro["benches"]:
            if b["error"]:
                out.append(f"| {b['name']} | failed: {b['error'][:80]} | | | |")
            for r in b["rows"]:
                per = f"{r['per_query_ms']:.3f}" if "per_query_ms" in r else ""
                out.append(f"| {b['name']} | {r['form']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {per} |")
        recalls = [(b["name"], r) for b in micro["benches"] for r in b.get("recalls", [])]
        if recalls:
            out += ["", "| bench | recall | value |", "|---|---|---|"]
            out += [f"| {name} | {r['what']} | {r['recall']:.4f} |" for name, r in recalls]
        out += ["", "Commands (each bench's full output is in the JSON):", ""]
        out += [f"- `{b['command']}`" for b in micro["benches"]] + [""]
    out += data_paths_markdown(doc)
    out += [f"![{c}]({c})" for c in charts]
    return "\n".join(out) + "\n"


def p99_mark(count: int | None) -> str:
    """``"*"`` after a p99 from fewer than 100 queries (the slowest of them, not a percentile), as ``recpipe
    report`` marks it on querygen runs and the curve rings it; ``""`` where the count is enough or unknown."""
    return "" if count is None or supported(99.0, int(count)) else "*"


def p99_note(counts: list[int | None]) -> str:
    """The footnote to a table where ``p99_mark`` marked a p99 (from ``counts`` queries), else ``""``."""
    if not any(p99_mark(n) for n in counts):
        return ""
    return (f"\\* from fewer than {min_samples(99.0)} queries: a p99 there is the slowest of them, not a "
            "percentile (run more queries).")


def clients(n: int) -> str:
    return f"{n} client{'s' * (n != 1)}"


def failures(doc: dict[str, Any], section: str, runs: list[tuple[str, dict[str, Any]]]) -> str:
    """``"1,364 of 1,442 at 2 clients; ..."`` for each of ``runs`` (a sweep point or an SLO step of ``section``,
    by name) with failed queries, and how its latencies count them (``document.counted``); empty where none
    failed. A failed query is no answer: p50/p99 count each until its deadline at least (however fast it
    failed), or, in a document from before, leave it out."""
    failed = [f"{int(r['errors']):,} of {int(r['queries']):,} at {name}" for name, r in runs if r.get("errors")]
    if not failed:
        return ""
    counted = ("each counts in p50/p99 as unanswered until its deadline at least, and not in q/s"
               if document.counted(doc, section)["latency"] == document.EVERY_QUERY else
               "p50/p99 leave them out (a document from before failed queries were counted)")
    return "; ".join(failed) + f" ({counted})."


def cpu_per(doc: dict[str, Any], section: str) -> str:
    """What serving section ``section``'s CPU per query divides over (``document.counted``), in words: the
    answered queries, or, in a document from before, every query sent (refused and timed-out ones too)."""
    return "answered query" if document.counted(doc, section)["cpu_per_query"] == document.ANSWERED else "query sent"


def not_run(doc: dict[str, Any]) -> dict[str, str]:
    """Why each section is missing or incomplete: the document's ``not_run``, and the sections the budget cut
    short (``document.cut_short``; a document from before ``not_run`` said so names them only there)."""
    short = {name: why for name, block in doc["sections"].items() if (why := document.cut_short(name, block))}
    return {**short, **(doc.get("not_run") or {})}


def unmet_line(search: dict[str, Any], seq: dict[str, Any] | None, peak: float | None) -> str:
    """For a search no rate met: its lowest p99 and its p99 at the lowest rate it tried (``peak``: the
    sweep's peak throughput, to say how light that load was), beside the sequential run's, so a bound
    under the chain's light-load tail reads as such (a lone query's hops each wake idle processes: the
    micro section's hop after idle); empty where a rate met it."""
    curve = search["curve"]
    if search["max_rate"] is not None or not curve:
        return ""
    best = min(curve, key=lambda st: st["p99_us"])
    low = min(curve, key=lambda st: st["target_rate"])
    line = f"\np99 <= {search['p99_bound_ms']:g} ms: no rate met it. "
    if best is not low:
        line += f"Its lowest p99 was {_ms(best['p99_us'])} ms, at {best['target_rate']:.1f} q/s; at "
    else:
        line += "At "
    line += f"the lowest rate tried, {low['target_rate']:.1f} q/s"
    light = peak is not None and low["target_rate"] <= peak / 4
    if peak:
        line += f" ({low['target_rate'] / peak:.0%} of the sweep's peak)"
    line += f", it was {_ms(low['p99_us'])} ms"
    if seq:
        line += f" (sequential: {_ms(block(seq, 'end_to_end')['p99_us'])} ms)"
    return line + (": the bound is under this chain's tail even at light load." if light else ".")


def _knee_queries(search: dict[str, Any]) -> tuple[int | None, int | None]:
    """The queries answered at the search's knee (``recpipe.querygen.slo.knee``): the step that met the
    bound and the one above it that missed; None where there is no such step, or a curve from before
    steps kept their counts."""
    def count(step: dict[str, Any] | None) -> int | None:
        return None if step is None or "queries" not in step else int(step["queries"])

    met, missed = knee(search["max_rate"], search["curve"])
    return count(met), count(missed)


def _cpu_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.2f}"


def _cpu_table(head: str, cpu: dict[str, float | None]) -> list[str]:
    return [head, "", "| " + " | ".join(cpu) + " |", "|---" * len(cpu) + "|",
            "| " + " | ".join(_cpu_ms(v) for v in cpu.values()) + " |", ""]


def own_work(where: str, cpu: dict[str, float | None], compute: dict[str, float | None] | None,
             stage_threads: dict[str, int] | None = None) -> str | None:
    """A line on how much of each stage's CPU per query its own core calls took (``compute_cpu_s_per_query``),
    the rest being what serving them cost; None for a document from before the split was measured. A
    stage with more than one library thread (``stage_threads``) is marked: only its core call's own
    thread is counted, so its share is a floor."""
    parts = []
    for stage, spent in (compute or {}).items():
        total = cpu.get(stage)
        if spent is not None and total:
            n = (stage_threads or {}).get(stage, 1)
            floor = f"; its calling thread only, of {n} threads" if n > 1 else ""
            parts.append(f"{stage} {_cpu_ms(spent)} of {_cpu_ms(total)} ({spent / total:.0%}{floor})")
    if not parts:
        return None
    return (f"{where}, the stages' own computing (their core calls' CPU, ms per query, of all their process's): "
            + ", ".join(parts) + "; the rest of each is serving the calls (gRPC, asyncio, decoding and encoding, "
            "batching, health).")


def own_work_of(where: str, run: dict[str, Any], seq: dict[str, Any] | None) -> str | None:
    """``own_work`` for a measured run of a document (the sequential run, or a sweep point) with the
    library threads its sequential run ``seq`` recorded."""
    return own_work(where, run["cpu_s_per_query"], run.get("compute_cpu_s_per_query"), threads(seq))


def threads(seq: dict[str, Any] | None) -> dict[str, int]:
    """Each stage's library threads, as its GetInfo said in the sequential run (none known: empty)."""
    pipeline = (seq or {}).get("pipeline") or {}
    return {name: int(info.get("threads") or 1) for name, info in pipeline.items() if isinstance(info, dict)}


#: fewest queries in the slowest 1% for the report to say where their time went (500 sequential queries)
TAIL_MIN_QUERIES = 5


def _tail_line(where: str, attribution: dict[str, Any] | None) -> list[str]:
    """Where the slowest 1% of a load's queries spent their time (``recpipe.querygen.attribution``): its
    three largest parts (a stage's server and hop time counted together) out of their end-to-end mean;
    nothing for a document from before the split was kept, or a load too short for its slowest 1% to be
    ``TAIL_MIN_QUERIES`` queries."""
    tail = (attribution or {}).get("p99")
    if not tail or tail["queries"] < TAIL_MIN_QUERIES:
        return []
    parts = {st: b["server_us"] + b["hop_us"] for st, b in tail["stages"].items()}
    parts.update(gateway=tail["gateway_us"], client=tail["client_us"])
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    shown = []
    for name, us in top:
        b = tail["stages"].get(name)
        inner = f" (server {_ms(b['server_us'])} + hop {_ms(b['hop_us'])})" if b else ""
        shown.append(f"{name} {_ms(us)}{inner}")
    return [f"{where}, the slowest 1% of queries ({tail['queries']}, {_ms(tail['end_to_end_us'])} ms end to end on "
            f"average) spent most in: " + ", ".join(shown) + " ms (`recpipe report` on a querygen run shows every "
            "part).", ""]


def _gpu_line(block: dict[str, Any]) -> list[str]:
    g = block.get("gpu_busy") or {}
    if g.get("measured"):
        peak = block.get("peak_gpu_busy")
        at_peak = f"; {peak:.2f} at the peak ({block.get('peak_concurrency')} clients)" if peak is not None else ""
        return [f"GPU busy fraction: {g['busy_fraction']:.2f} ({g['samples']} samples){at_peak}", ""]
    return [f"GPU busy fraction: unmeasured ({g.get('reason', '?')})", ""]


def not_measured(block: dict[str, Any] | None) -> str:
    """Why a data-paths block holds no figures (empty when it does)."""
    if block is None:
        return "not measured: no data paths section (a characterization from before it existed)"
    return "" if block.get("measured") else f"not measured: {block.get('reason') or '?'}"


def _gbps(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _ns(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def paths_headline(block: dict[str, Any]) -> str:
    """One line: pinned H2D/D2H at the largest size, the small-copy floor, the placement."""
    if why := not_measured(block):
        return why
    top = max(block["plan"]["copy_bytes"])
    h2d, d2h = (datapaths.find_copy(block, d, "pinned", top) or {} for d in datapaths.DIRECTIONS)
    small = block["small_copy"]
    line = (f"pinned {datapaths.fmt_bytes(top)} H2D {_gbps(h2d.get('gbps'))} GB/s, D2H {_gbps(d2h.get('gbps'))} "
            f"GB/s; small copy H2D {_us(small['h2d']['host_us'])} µs, D2H {_us(small['d2h']['host_us'])} µs")
    place = block.get("placement")
    if place:
        line += f"; host tables at {place['host_over_device']:.0%} of GPU-resident"
    return line


def transfer_rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per step with copies (retrieve, rank): its bytes and copies per query (sequential), the time they
    take on the measured paths, and that time's share of the stage's compute mean and of its p50."""
    sec = doc["sections"]
    seq = sec.get("sequential") or {}
    per_stage = seq.get("transfers_per_query") or {}
    block = sec.get("data_paths") or {}
    times = datapaths.stage_transfers(block, per_stage)
    out = {}
    for step in STEPS:
        q = per_stage.get(STEP_STAGES[step])
        if not q:
            continue
        t = times.get(STEP_STAGES[step], {}).get("total_us")
        stage = seq["stages"][step]
        out[step] = {**q, "transfer_us": t, "of_compute": datapaths.ratio(t, stage["compute"]["mean_us"]),
                     "of_p50": datapaths.ratio(t, stage["p50_us"])}
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def data_paths_markdown(doc: dict[str, Any]) -> list[str]:
    block = doc["sections"].get("data_paths")
    out = ["## Data paths (CPU <-> GPU)", ""]
    if why := not_measured(block):
        out += [f"_{why}._", ""]
    else:
        assert block is not None
        plan = block["plan"]
        out += [f"{block['device']}: {block['method']}; {plan['repeats']} repeats after {plan['warmup']} warm-ups. "
                "GB/s are 1e9 bytes per second.", "",
                "| size | H2D pinned GB/s | H2D pageable GB/s | D2H pinned GB/s | D2H pageable GB/s |", "|---|---|---|---|---|"]
        for n in plan["copy_bytes"]:
            cells = [_gbps((datapaths.find_copy(block, d, m, n) or {}).get("gbps"))
                     for d in datapaths.DIRECTIONS for m in ("pinned", "pageable")]
            out.append(f"| {datapaths.fmt_bytes(n)} | " + " | ".join(cells) + " |")
        small = block["small_copy"]
        out += ["", f"One small copy ({small['bytes']} B, pinned), the floor of a per-request transfer: H2D "
                f"{_us(small['h2d']['device_us'])} µs on the device, {_us(small['h2d']['host_us'])} µs as the host "
                f"waits; D2H {_us(small['d2h']['device_us'])} / {_us(small['d2h']['host_us'])} µs.", ""]
        chk = block["torch_check"]
        verdict = "no figure" if chk["within"] is None else \
            f"ratio {chk['ratio']:.3f}, {'within' if chk['within'] else 'NOT within'} {chk['tolerance']:.0%}"
        out += [f"Cross-check: pinned H2D at {datapaths.fmt_bytes(chk['bytes'])} {_gbps(chk['events_gbps'])} GB/s "
                f"(CUDA events) vs {_gbps(chk['torch_gbps'])} GB/s (a plain torch copy, host clock): {verdict}.", "",
                f"Gathers ({plan['lookups']} rows from a {datapaths.fmt_bytes(plan['table_bytes'])} table):", "",
                "| table | dtype | row B | ids | GPU memory GB/s | host memory GB/s | host / GPU | GPU ns/row | "
                "host ns/row |", "|---|---|---|---|---|---|---|---|---|"]
        for g in block["gathers"]:
            if g["where"] != datapaths.DEVICE:
                continue
            h = datapaths.find_gather(block, g["table"], g["dtype"], g["order"], datapaths.HOST) or {}
            share = datapaths.ratio(h.get("gbps"), g["gbps"])
            out.append(f"| {g['table']} | {g['dtype']} | {g['row_bytes']} | {g['order']} | {_gbps(g['gbps'])} | "
                       f"{_gbps(h.get('gbps'))} | {'-' if share is None else f'{share:.0%}'} | "
                       f"{_ns(g['ns_per_row'])} | {_ns(h.get('ns_per_row'))} |")
        if place := block.get("placement"):
            out += ["", f"**Placement:** {place['advice']}"]
        out += [""]
    rows = transfer_rows(doc)
    if rows:
        out += ["Copies per query between host and device (sequential run, the stages' GetInfo before and after), "
                "and the time they take on the measured pinned paths:", "",
                "| stage | H2D B/query | H2D copies | D2H B/query | D2H copies | transfer µs | of compute mean | "
                "of p50 |", "|---|---|---|---|---|---|---|---|"]
        for step, r in rows.items():
            out.append(f"| {step} | {r['h2d_bytes']:.0f} | {r['h2d_copies']:g} | {r['d2h_bytes']:.0f} | "
                       f"{r['d2h_copies']:g} | {_us(r['transfer_us'])} | {_pct(r['of_compute'])} | "
                       f"{_pct(r['of_p50'])} |")
        out += [""]
    return out


def write(doc: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    drawn = [_save(curve_figure([("", doc)]), out / CHARTS[0], force=True),
             _save(stages_figure(doc), out / CHARTS[1], force=True),
             _save(split_figure(doc), out / CHARTS[2], force=True)]
    write_atomic(out / MARKDOWN, markdown(doc).encode(), force=True)
    return drawn


def summary(doc: dict[str, Any]) -> str:
    """A few lines for stdout: the headline numbers of each finished section."""
    sec = doc["sections"]
    lines = [f"characterization: {title(doc)}"]
    if seq := sec.get("sequential"):
        lines.append("sequential p50 ms: " + ", ".join(f"{s} {_ms(seq['stages'][s]['p50_us'])}" for s in STEPS)
                     + f"; end to end {_ms(block(seq, 'end_to_end')['p50_us'])} (p99 {_ms(block(seq, 'end_to_end')['p99_us'])})")
    if sweep := sec.get("sweep"):
        failed = sum(int(p.get("errors") or 0) for p in sweep["points"])
        lines.append(f"sweep: peak {sweep['peak_throughput'] or 0:.1f} q/s at {clients(sweep['peak_concurrency'] or 0)} "
                     f"({sweep['stop_reason']})" + (f"; {failed:,} queries failed" if failed else ""))
    if slo := sec.get("slo"):
        lines.append("slo: " + ", ".join(f"p99 <= {s['p99_bound_ms']:g} ms: "
                                         + ("none" if s["max_rate"] is None else f"{s['max_rate']:.1f} q/s")
                                         for s in slo["searches"]))
    if micro := sec.get("micro"):
        lines.append(f"micro: {len(micro['benches'])} benches, "
                     f"{sum(1 for b in micro['benches'] if b['error'])} failed")
    if paths := sec.get("data_paths"):
        lines.append("data paths: " + paths_headline(paths))
    if left := not_run(doc):
        lines.append(f"not run or cut short (budget): {', '.join(left)}")
    return "\n".join(lines)
