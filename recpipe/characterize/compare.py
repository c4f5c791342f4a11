"""Two (or more) characterizations side by side, section by section, with speed-ups over the first.

A speed-up is ``baseline / run`` for a latency or CPU time (2.00x: the run takes half) and
``run / baseline`` for a throughput or a rate (2.00x: the run serves twice as much); above 1.00x the
run is better. ``differences`` names the settings that must match for the ratios to mean something
(``recpipe.characterize.settings.COMPARABLE``); the platform-side ones (device, threads, ...) are what
a comparison varies, and are listed, not refused.

The data paths (bandwidth each way, pinned and pageable; the small-copy latency; gathers from GPU and
from host memory; the placement advice) are compared path by path, and each stage's latency speed-up is
shown beside the speed-up of the time its copies take: where a stage got faster, whether its transfers
explain it. A characterization without the section (written before it existed, or on a CPU) shows
"not measured" there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from recpipe.characterize import cpu_probe, datapaths, load, report, settings
from recpipe.config import STEPS
from recpipe.querygen.compare import block, speedup
from recpipe.querygen.plots import _COLORS, _figure, png

Runs = Sequence[tuple[str, dict[str, Any]]]
CHARTS = ("curves.png", "stages.png")
#: two documents naming the same CPU whose probes differ by more than this factor get a warning
CPU_SPEED_TOLERANCE = 1.15

#: settings shown side by side (varied by a comparison, so not refused)
_VARIED = ("device", "threads", "replicas", "affinity", "workers", "serve_args", "data", "models")


#: sizes a comparison may vary: the SLO table compares bound by bound ("not searched" where a run has no
#: search at that bound), and a CPU and a GPU are rightly asked different bounds
_PER_ROW = ("sizes.slo_bounds_ms ",)
#: the sizes that only say where a sweep stops, its p99 bound and its largest number of clients (the
#: sweep table compares clients by clients, "-" where a run has no point), each with whether it stopped
#: a sweep: a difference in one makes two runs unlike only where it stopped one of them
_SWEEP_STOPS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "sizes.sweep_p99_ms ": lambda sweep: (not settings.stopped_for_failures(str(sweep.get("stop_reason", "")))
                                          and settings.past_sweep_bound(sweep["points"][-1]["p99_us"],
                                                                        sweep["p99_bound_ms"])),
    "sizes.max_concurrency ": lambda sweep: settings.reached_cap(str(sweep.get("stop_reason", ""))),
}


def differences(base: dict[str, Any], run: dict[str, Any]) -> list[str]:
    moot = tuple(prefix for prefix, stopped in _SWEEP_STOPS.items()
                 if not (_sweep_stopped(base, stopped) or _sweep_stopped(run, stopped)))
    return [d for d in settings.differences(base["settings"], run["settings"])
            if not d.startswith(_PER_ROW) and not d.startswith(moot)]


def _sweep_stopped(doc: dict[str, Any], stopped: Callable[[dict[str, Any]], bool]) -> bool:
    """Whether ``doc``'s sweep ended as ``stopped`` says (a document without a sweep: as if it had)."""
    sweep = doc["sections"].get("sweep")
    return not sweep or not sweep.get("points") or stopped(sweep)


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if not num or not den else num / den


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:.3f}"


def markdown(runs: Runs, unlike: Sequence[str] = (), charts: Sequence[str] = CHARTS) -> str:
    labels = [label for label, _ in runs]
    base_label, base = runs[0]
    others = runs[1:]
    out = ["# recpipe characterizations compared", "",
           f"Speed-ups are relative to **{base_label}**; above 1.00x is better (less time, more throughput).", ""]
    if unlike:
        out += ["**Warning: these characterizations differ in settings that must match, so the speed-ups "
                "compare unlike things (compared anyway with --force):** " + "; ".join(unlike), ""]
    out += ["| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(runs)]
    out.append("| platform | " + " | ".join(report.title(doc).replace("|", "/") for _, doc in runs) + " |")
    probes = [(doc["sections"].get("platform") or {}).get("cpu_probe") for _, doc in runs]
    out.append("| CPU probe | " + " | ".join(cpu_probe.describe(p) for p in probes) + " |")
    for key in _VARIED:
        out.append(f"| {key} | " + " | ".join(str(settings.value(doc["settings"], key)) for _, doc in runs) + " |")
    out.append("| sections | " + " | ".join(", ".join(doc["sections"]) for _, doc in runs) + " |")
    out += [""]
    out += cpu_speed_warnings(runs)
    out += _sequential(runs) + _cpu(runs) + _sweep(runs) + _slo(runs) + _micro(runs) + _data_paths(runs)
    if others:
        out += ["## Verdict", ""]
        for label, doc in others:
            out.append(f"- {verdict(label, base, doc)}")
        out.append("")
    out += [f"![{c}]({c})" for c in charts]
    return "\n".join(out) + "\n"


def cpu_speed_warnings(runs: Runs) -> list[str]:
    """A paragraph for each document that names the base's CPU but ran its probe (``cpu_probe``) more than
    ``CPU_SPEED_TOLERANCE`` faster or slower: its CPU-bound figures measure that machine's state."""
    base_label, base = runs[0]
    plat = base["sections"].get("platform") or {}
    out = []
    for label, doc in runs[1:]:
        other = doc["sections"].get("platform") or {}
        ratio = cpu_probe.speed_ratio(plat.get("cpu_probe"), other.get("cpu_probe"))
        if ratio is None or other.get("cpu") != plat.get("cpu") or 1 / CPU_SPEED_TOLERANCE <= ratio <= CPU_SPEED_TOLERANCE:
            continue
        out += [f"**Warning: {label} and {base_label} name the same CPU ({plat.get('cpu')}), but {label}'s ran the "
                f"CPU probe {ratio:.2f}x as fast** (SHA-256 and matmul, one thread): its figures that the CPU "
                "bounds (stage and hop times, CPU per query, throughput) measure that machine's state as much as "
                "the code. Compare runs from one machine, or rerun where the probes agree.", ""]
    return out


def verdict(label: str, base: dict[str, Any], run: dict[str, Any]) -> str:
    """e.g. ``"B: sequential end to end 1.23x (p50); augment_user 1.00x; ...; peak throughput 1.50x"``."""
    parts = []
    a, b = base["sections"].get("sequential"), run["sections"].get("sequential")
    if a and b:
        e2e = speedup(block(a, "end_to_end")["p50_us"], block(b, "end_to_end")["p50_us"])
        parts.append(f"sequential end to end {_x(e2e)} (p50)")
        parts += [f"{s} {_x(speedup(a['stages'][s]['p50_us'], b['stages'][s]['p50_us']))}" for s in STEPS]
    a, b = base["sections"].get("sweep"), run["sections"].get("sweep")
    if a and b:
        parts.append(f"peak throughput {_x(_ratio(b['peak_throughput'], a['peak_throughput']))}")
    a, b = base["sections"].get("data_paths"), run["sections"].get("data_paths")
    if a and b and a.get("measured") and b.get("measured"):
        top = max(set(a["plan"]["copy_bytes"]) & set(b["plan"]["copy_bytes"]), default=None)
        if top is not None:
            h2d = [(datapaths.find_copy(x, datapaths.H2D, "pinned", top) or {}).get("gbps") for x in (a, b)]
            parts.append(f"pinned H2D {datapaths.fmt_bytes(top)} {_x(_ratio(h2d[1], h2d[0]))}")
        host = [(x.get("placement") or {}).get("host_gbps") for x in (a, b)]
        parts.append(f"host-memory table gather {_x(_ratio(host[1], host[0]))}")
    return f"{label}: " + ("; ".join(parts) if parts else "no section both finished")


def _both(runs: Runs, name: str) -> bool:
    return all(name in doc["sections"] for _, doc in runs)


def _missing(runs: Runs, name: str) -> list[str]:
    lacking = [label for label, doc in runs if name not in doc["sections"]]
    return [f"_{name}: not in {', '.join(lacking)}; not compared._", ""]


def _sequential(runs: Runs) -> list[str]:
    out = ["## Sequential per-stage latency (ms)", ""]
    if not _both(runs, "sequential"):
        return out + _missing(runs, "sequential")
    labels = [lb for lb, _ in runs]
    head = "| stage | " + " | ".join(f"{lb} p50 | {lb} p99" for lb in labels)
    head += "".join(f" | {lb} speed-up p50 | {lb} speed-up p99" for lb in labels[1:]) + " |"
    out += [head, "|---" * (1 + 2 * len(runs) + 2 * (len(runs) - 1)) + "|"]
    base = runs[0][1]["sections"]["sequential"]
    counts: list[int | None] = []  # the queries of each p99 (a quick run's 40: the slowest of them, marked)
    for row in (*STEPS, "end_to_end"):  # end to end over every query, a failed one until its deadline at least
        cells = []
        for _, doc in runs:
            b = block(doc["sections"]["sequential"], row)
            counts.append(b.get("count"))
            cells += [_ms(b["p50_us"]), _ms(b["p99_us"]) + report.p99_mark(b.get("count"))]
        for _, doc in runs[1:]:
            b = block(doc["sections"]["sequential"], row)
            flag = report.p99_mark(block(base, row).get("count")) or report.p99_mark(b.get("count"))
            cells += [_x(speedup(block(base, row)["p50_us"], b["p50_us"])),
                      _x(speedup(block(base, row)["p99_us"], b["p99_us"])) + flag]
        out.append(f"| {'**end to end**' if row == 'end_to_end' else row} | " + " | ".join(cells) + " |")
    if note := report.p99_note(counts):
        out += ["", note]
    out += ["", "Where the time goes (sequential, mean ms: queue / compute / network):", "",
            "| stage | " + " | ".join(labels) + " |", "|---" * (1 + len(runs)) + "|"]
    for stage in STEPS:
        cells = []
        for _, doc in runs:
            p = report.split(doc["sections"]["sequential"]["stages"][stage])
            cells.append(f"{_ms(p['queue'])} / {_ms(p['compute'])} / {_ms(p['network'])}")
        out.append(f"| {stage} | " + " | ".join(cells) + " |")
    return [*out, ""]


def _cpu(runs: Runs) -> list[str]:
    if not _both(runs, "sequential"):
        return []
    labels = [lb for lb, _ in runs]
    per = {lb: report.cpu_per(doc, "sequential") for lb, doc in runs}  # a document from before: per query sent
    unlike = ["CPU per " + "; ".join(f"{w} in {lb}" for lb, w in per.items()) + ": alike only where no query "
              "failed.", ""] if len(set(per.values())) > 1 else []
    out = ["## CPU time per query per process (sequential, ms of CPU; speed-up = less CPU)", "", *unlike,
           "| process | " + " | ".join(labels) + "".join(f" | {lb} speed-up" for lb in labels[1:]) + " |",
           "|---" * (1 + 2 * len(runs) - 1) + "|"]
    base = runs[0][1]["sections"]["sequential"]["cpu_s_per_query"]
    for proc in base:
        values = [doc["sections"]["sequential"]["cpu_s_per_query"].get(proc) for _, doc in runs]
        cells = ["-" if v is None else f"{v * 1000:.2f}" for v in values]
        cells += [_x(_ratio(base[proc], v)) for v in values[1:]]
        out.append(f"| {proc} | " + " | ".join(cells) + " |")
    seqs = [(lb, doc["sections"]["sequential"]) for lb, doc in runs]
    own = [line for lb, seq in seqs if (line := report.own_work_of(f"- {lb}", seq, seq))]
    return [*out, "", *own, *([""] if own else [])]


def _sweep(runs: Runs) -> list[str]:
    out = ["## Closed-loop concurrency sweep", ""]
    if not _both(runs, "sweep"):
        return out + _missing(runs, "sweep")
    labels = [lb for lb, _ in runs]
    sweeps = [doc["sections"]["sweep"] for _, doc in runs]
    line = "Peak throughput: " + "; ".join(
        f"{lb} {s['peak_throughput'] or 0:.1f} q/s at {s['peak_concurrency']} clients ({s['stop_reason']})"
        for lb, s in zip(labels, sweeps, strict=True))
    for lb, s in zip(labels[1:], sweeps[1:], strict=True):
        line += f"; {lb} speed-up {_x(_ratio(s['peak_throughput'], sweeps[0]['peak_throughput']))}"
    out.append(line + ".")
    out += ["", "| clients | " + " | ".join(f"{lb} q/s | {lb} p99 ms" for lb in labels)
            + "".join(f" | {lb} q/s speed-up | {lb} p99 speed-up" for lb in labels[1:]) + " |",
            "|---" * (1 + 2 * len(runs) + 2 * (len(runs) - 1)) + "|"]
    by_c = [{p["concurrency"]: p for p in s["points"]} for s in sweeps]
    for c in sorted(set().union(*by_c)):
        points = [b.get(c) for b in by_c]
        cells = []
        for p in points:
            cells += ["-", "-"] if p is None else [f"{p['throughput']:.1f}", _ms(p["p99_us"]) + report.p99_mark(p["queries"])]
        b0 = points[0]
        for p in points[1:]:
            if p is None or b0 is None:
                cells += ["n/a", "n/a"]
            else:
                flag = report.p99_mark(b0["queries"]) or report.p99_mark(p["queries"])
                cells += [_x(_ratio(p["throughput"], b0["throughput"])), _x(speedup(b0["p99_us"], p["p99_us"])) + flag]
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    if note := report.p99_note([p["queries"] for s in sweeps for p in s["points"]]):
        out += ["", note]
    failed = [f"- {lb}'s failed queries: {text}" for (lb, doc), s in zip(runs, sweeps, strict=True)
              if (text := report.failures(doc, "sweep", [(report.clients(p["concurrency"]), p) for p in s["points"]]))]
    out += ["", *failed] if failed else []
    busy = []  # what each run's peak kept busy (documents from before runs recorded their load say nothing)
    for lb, s, b in zip(labels, sweeps, by_c, strict=True):
        peak = b.get(s["peak_concurrency"]) or {}
        if what := load.describe(peak.get("load"), peak.get("gpu_busy")):
            busy.append(f"- {lb}'s peak kept busy: {what}")
    return [*out, "", *busy, *([""] if busy else [])]


def _slo(runs: Runs) -> list[str]:
    out = ["## SLO search: highest rate with p99 under the bound (q/s)", ""]
    if not _both(runs, "slo"):
        return out + _missing(runs, "slo")
    labels = [lb for lb, _ in runs]
    found = [{s["p99_bound_ms"]: s["max_rate"] for s in doc["sections"]["slo"]["searches"]} for _, doc in runs]
    out += ["| p99 bound ms | " + " | ".join(labels) + "".join(f" | {lb} speed-up" for lb in labels[1:]) + " |",
            "|---" * (1 + 2 * len(runs) - 1) + "|"]
    for bound in sorted(set().union(*found)):
        rates = [f.get(bound) for f in found]
        cells = ["not searched" if bound not in f else "none met" if r is None else f"{r:.1f}"
                 for f, r in zip(found, rates, strict=True)]
        cells += [_x(_ratio(r, rates[0])) for r in rates[1:]]
        out.append(f"| {bound:g} | " + " | ".join(cells) + " |")
    return [*out, ""]


def _micro(runs: Runs) -> list[str]:
    out = ["## Micro-benchmarks (p50 ms)", ""]
    if not _both(runs, "micro"):
        return out + _missing(runs, "micro")
    labels = [lb for lb, _ in runs]
    tables = [{(b["name"], r["form"]): r for b in doc["sections"]["micro"]["benches"] for r in b["rows"]}
              for _, doc in runs]
    keys = list(tables[0]) + [k for t in tables[1:] for k in t if k not in tables[0]]
    out += ["| bench | form | " + " | ".join(labels) + "".join(f" | {lb} speed-up" for lb in labels[1:]) + " |",
            "|---" * (2 + 2 * len(runs) - 1) + "|"]
    for key in keys:
        rows = [t.get(key) for t in tables]
        cells = ["-" if r is None else f"{r['p50_ms']:.3f}" for r in rows]
        for r in rows[1:]:
            b0 = rows[0]
            cells.append("n/a" if r is None or b0 is None else _x(speedup(b0["p50_ms"] * 1000, r["p50_ms"] * 1000)))
        out.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    recalls = [{(b["name"], r["what"]): r["recall"] for b in doc["sections"]["micro"]["benches"]
                for r in b.get("recalls", [])} for _, doc in runs]
    if any(recalls):
        out += ["", "| bench | recall | " + " | ".join(labels) + " |", "|---" * (2 + len(runs)) + "|"]
        for key in dict.fromkeys(k for r in recalls for k in r):
            out.append(f"| {key[0]} | {key[1]} | " + " | ".join(
                "-" if r.get(key) is None else f"{r[key]:.4f}" for r in recalls) + " |")
    return [*out, ""]


def _paths_value(block: dict[str, Any] | None, key: tuple[str, ...]) -> float | None:
    """One figure of a data-paths block: ``("copy", direction, memory, bytes)``, ``("small", direction,
    clock)`` or ``("gather", table, dtype, order, where)`` (GB/s, or µs for the small copy)."""
    if not block or not block.get("measured"):
        return None
    if key[0] == "copy":
        row = datapaths.find_copy(block, key[1], key[2], int(key[3]))
        return row["gbps"] if row else None
    if key[0] == "small":
        return ((block.get("small_copy") or {}).get(key[1]) or {}).get(f"{key[2]}_us")
    row = datapaths.find_gather(block, *key[1:])
    return row["gbps"] if row else None


def _paths_label(key: tuple[str, ...]) -> str:
    if key[0] == "copy":
        return f"{key[1].upper()} {key[2]} {datapaths.fmt_bytes(int(key[3]))} GB/s"
    if key[0] == "small":
        return f"one small {key[1].upper()} copy, µs ({key[2]} clock)"
    return f"gather {key[1]} {key[2]} {key[3]} ids, {'GPU' if key[4] == datapaths.DEVICE else 'host'} memory GB/s"


def _data_paths(runs: Runs) -> list[str]:
    labels = [lb for lb, _ in runs]
    blocks = [doc["sections"].get("data_paths") for _, doc in runs]
    out = ["## Data paths (CPU <-> GPU; speed-up: more GB/s, less time)", ""]
    out += [f"- {lb}: {report.not_measured(b) or b['device']}" for lb, b in zip(labels, blocks, strict=True)] + [""]
    keys: list[tuple[str, ...]] = []
    for b in blocks:
        if not b or not b.get("measured"):
            continue
        for c in b["copies"]:
            keys.append(("copy", c["direction"], c["memory"], str(c["bytes"])))
        keys += [("small", d, clock) for d in datapaths.DIRECTIONS for clock in ("device", "host")]
        keys += [("gather", g["table"], g["dtype"], g["order"], g["where"]) for g in b["gathers"]]
    keys = list(dict.fromkeys(keys))
    if keys:
        out += ["| path | " + " | ".join(labels) + "".join(f" | {lb} speed-up" for lb in labels[1:]) + " |",
                "|---" * (1 + 2 * len(runs) - 1) + "|"]
        for key in keys:
            values = [_paths_value(b, key) for b in blocks]
            cells = ["not measured" if v is None else f"{v:.2f}" for v in values]
            # a latency is faster when it shrinks, a bandwidth when it grows
            cells += [_x(_ratio(values[0], v) if key[0] == "small" else _ratio(v, values[0])) for v in values[1:]]
            out.append(f"| {_paths_label(key)} | " + " | ".join(cells) + " |")
        out += ["", "| placement of the DLRM tables | " + " | ".join(labels) + " |", "|---" * (1 + len(runs)) + "|"]
        places = [(b or {}).get("placement") for b in blocks]
        out.append("| host memory / GPU memory gather | " + " | ".join(
            "not measured" if p is None else f"{p['host_over_device']:.0%}" for p in places) + " |")
        out.append("| advice | " + " | ".join(
            "not measured" if p is None else p["advice"].replace("|", "/") for p in places) + " |")
        checks = [(b or {}).get("torch_check") for b in blocks]
        out.append("| pinned H2D vs a plain torch copy | " + " | ".join(
            "not measured" if c is None or c["ratio"] is None
            else f"{c['ratio']:.3f} ({'within' if c['within'] else 'NOT within'} {c['tolerance']:.0%})"
            for c in checks) + " |")
        out += [""]
    out += _transfers(runs)
    return out


def _transfers(runs: Runs) -> list[str]:
    """Each stage's latency speed-up beside the speed-up of its copies' time (sequential)."""
    if not _both(runs, "sequential"):
        return []
    labels = [lb for lb, _ in runs]
    rows = [report.transfer_rows(doc) for _, doc in runs]
    steps = [s for s in STEPS if any(s in r for r in rows)]
    if not steps:
        return ["_Copies per query: not measured (no stage reported them)._", ""]
    out = ["Stage latency and the time its copies between host and device take (sequential; µs per query on "
           "the measured pinned paths):", "",
           "| stage | " + " | ".join(f"{lb} p50 ms | {lb} transfer µs" for lb in labels)
           + "".join(f" | {lb} stage speed-up | {lb} transfer speed-up" for lb in labels[1:]) + " |",
           "|---" * (1 + 2 * len(runs) + 2 * (len(runs) - 1)) + "|"]
    seqs = [doc["sections"]["sequential"] for _, doc in runs]
    for step in steps:
        cells = []
        t = [(r.get(step) or {}).get("transfer_us") for r in rows]
        for seq, tu in zip(seqs, t, strict=True):
            cells += [_ms(seq["stages"][step]["p50_us"]), "not measured" if tu is None else f"{tu:.1f}"]
        for seq, tu in zip(seqs[1:], t[1:], strict=True):
            cells += [_x(speedup(seqs[0]["stages"][step]["p50_us"], seq["stages"][step]["p50_us"])),
                      _x(_ratio(t[0], tu))]
        out.append(f"| {step} | " + " | ".join(cells) + " |")
    return [*out, ""]


def stages_figure(runs: Runs) -> Any:
    """Sequential per-stage p50, one stacked bar per characterization."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    have = [(lb, doc["sections"]["sequential"]) for lb, doc in runs if "sequential" in doc["sections"]]
    bottom = [0.0] * len(have)
    for stage in STEPS:
        values = [seq["stages"][stage]["p50_us"] / 1000 for _, seq in have]
        ax.bar([lb for lb, _ in have], values, bottom=bottom, color=_COLORS[stage], label=stage)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if have:
        ax.set_ylim(top=max(bottom) * 1.35)  # room for the legend above the bars
        ax.legend(fontsize=8, ncols=2)
    else:
        ax.text(0.5, 0.5, "no sequential section", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("per-stage p50, stacked (ms)")
    ax.set_xlabel("characterization")
    ax.set_title("sequential per-stage latency", fontsize=10)
    return fig


def files(runs: Runs, unlike: Sequence[str]) -> dict[str, bytes | str]:
    """The comparison's files by name, drawn in memory (``recpipe report`` writes them as one set):
    its charts (``CHARTS``) and report.md."""
    return {CHARTS[0]: png(report.curve_figure(list(runs))), CHARTS[1]: png(stages_figure(runs)),
            "report.md": markdown(runs, unlike)}
