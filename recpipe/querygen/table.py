"""The one per-stage table that ``recpipe querygen``, ``recpipe demo`` and ``recpipe serve`` print.

Every header cell carries its unit; a machine line says where the numbers come from (CPU model,
cores, GPU, and each stage's device and compute threads); a short legend says what server, observed
and client time are; percentiles that the sample cannot support are left out and said so.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from recpipe.config import STEPS
from recpipe.stages import REGISTRY

#: the percentile columns of the table: (label, JSON key, percentile)
COLUMNS: tuple[tuple[str, str, float], ...] = (
    ("p50", "p50_us", 50.0),
    ("p90", "p90_us", 90.0),
    ("p99", "p99_us", 99.0),
    ("p99.9", "p999_us", 99.9),
)

LEGEND = (
    "server = time inside the stage's own server; observed = time the gateway (or, --per-component, this "
    "client) waited for the stage, network and (de)serialisation included; client = the whole query as "
    "this generator saw it, from its scheduled send time; queue/compute = server time split by the "
    "stage's batcher (queued, then the core call), with the mean batch size."
)
#: the legend's line for the row a run with failed queries adds under end to end
LEGEND_FAILED = (" + failed = every query, the failed ones timed from their scheduled send to their failure or "
                 "their deadline, whichever came later (the other rows hold the answered queries only).")


def min_samples(percentile: float) -> int:
    """Fewest samples for which ``percentile`` is more than the largest value seen: 1 / (1 - p).

    p99 needs 100, p99.9 about 1,000, p99.99 about 10,000 (MLPerf LoadGen sets its minimum query counts
    by the same reasoning).
    """
    if percentile >= 100:
        return 1
    return round(1.0 / (1.0 - percentile / 100.0))


def supported(percentile: float, count: int) -> bool:
    return count >= min_samples(percentile)


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def machine_line(platform: Mapping[str, Any] | None, pipeline: Mapping[str, Any] | None) -> str:
    """``machine: CPU MODEL, N cores, GPU NAME | features cpu 1 thread, ...`` (``?`` where unknown)."""
    plat = platform or {}
    head = (f"machine: {plat.get('cpu', '?')}, {plat.get('cores', '?')} cores, GPU {plat.get('gpu', '?')}")
    parts = []
    for name in REGISTRY.names:
        info = (pipeline or {}).get(name)
        if not isinstance(info, Mapping) or not info.get("device"):
            continue
        threads = int(info.get("threads") or 0)
        what = f"{threads} thread{'s' if threads != 1 else ''}" if threads else "default threads"
        parts.append(f"{name} {info['device']} {what}")
    return head + (" | " + ", ".join(parts) if parts else " | stages: device and threads not reported")


class _Table:
    """Fixed-width columns, the first left-aligned."""

    def __init__(self, header: Sequence[str], first_width: int = 22, left: Sequence[int] = (1,)) -> None:
        self.header = list(header)
        self.left = set(left)
        self.rows: list[list[str]] = []
        self.first_width = first_width

    def add(self, row: Sequence[str]) -> None:
        self.rows.append(list(row) + [""] * (len(self.header) - len(row)))

    def render(self) -> list[str]:
        widths = [max(len(r[i]) for r in (self.header, *self.rows)) for i in range(len(self.header))]
        widths[0] = max(widths[0], self.first_width)

        def line(cells: Sequence[str]) -> str:
            # The first column (and a text second column) left-aligned, numbers right-aligned.
            out = f"{cells[0]:<{widths[0]}}"
            for i, (c, w) in enumerate(zip(cells[1:], widths[1:], strict=True), start=1):
                out += f"  {c:<{w}}" if i in self.left else f"  {c:>{w}}"
            return out.rstrip()

        return [line(self.header), "-" * len(line(self.header))] + [line(r) for r in self.rows]


def _cells(block: Mapping[str, Any], count: int) -> list[str]:
    return [(_ms(block[key]) if supported(p, count) else "-") for _, key, p in COLUMNS] + [_ms(block["max_us"])]


def _split_reported(doc: Mapping[str, Any]) -> bool:
    return any(((doc["stages"][s].get("batch_size") or {}).get("count") or 0) > 0 for s in STEPS)


def run_table(doc: Mapping[str, Any]) -> str:
    """The whole summary of one run document (what querygen and demo print)."""
    lines = [_headline(doc), machine_line(doc.get("platform"), doc.get("pipeline"))]
    header = ["stage", "time", *(f"{label} (ms)" for label, _, _ in COLUMNS), "max (ms)", "mean (ms)",
              "batch (mean)"]
    table = _Table(header, 14)
    split = _split_reported(doc)
    for stage in STEPS:
        s = doc["stages"][stage]
        table.add([stage, "observed", *_cells(s, int(s.get("count", 0))), _ms(s["mean_us"])])
        srv = s["server"]
        table.add(["", "server", *_cells(srv, int(srv.get("count", 0))), _ms(srv["mean_us"])])
        batch = s.get("batch_size") or {}
        if split and batch.get("count"):
            for part in ("queue", "compute"):
                b = s[part]
                row = ["", f"  {part}", *_cells(b, int(b.get("count", 0))), _ms(b["mean_us"])]
                if part == "compute":
                    row.append(f"{batch['mean']:.2f}")
                table.add(row)
    e = doc["end_to_end"]
    n = int(e.get("count", doc.get("ok", 0)))
    table.add(["end to end", "client", *_cells(e, n), _ms(e["mean_us"])])
    every = doc.get("end_to_end_all")
    failed = bool(every and (doc.get("failed") or {}).get("count"))
    if every and failed:  # a deadline's failures are the slowest queries: the answered rows alone hide them
        table.add(["", "+ failed", *_cells(every, int(every["count"])), _ms(every["mean_us"])])
    lines += table.render()
    lines += attribution_lines(doc)
    notes = support_warnings(doc)
    if not split:
        notes.append("queue/compute split: not reported by these stages (StageTiming.queue_us/compute_us are 0)")
    if doc.get("mode") == "open":
        lag = doc["send_lag"]
        share = lag.get("late_share")
        late = "" if share is None else f", {share * 100:.2f}% sent more than 1 ms late"
        notes.append(f"send lag: p50 {_ms(lag['p50_us'])} ms, p99 {_ms(lag['p99_us'])} ms, max {_ms(lag['max_us'])} ms{late}")
    gen = doc.get("generator") or {}
    if gen.get("processes", 1) > 1:
        head = f"senders: {gen['processes']} processes ({gen['processes_reason']})"
        if doc.get("mode") == "open":
            per = "; ".join(f"{s['process']}: p50 {_ms(s['send_lag']['p50_us'])}, p99 {_ms(s['send_lag']['p99_us'])}, "
                            f"max {_ms(s['send_lag']['max_us'])}" for s in gen["senders"])
            notes.append(f"{head}; send lag per process (ms) {per}")
        else:  # a closed loop sends when an answer comes back: it has no schedule to lag behind
            notes.append(f"{head}; queries per process " + ", ".join(str(s["queries"]) for s in gen["senders"]))
    slo = doc.get("slo")
    if slo:
        best = "none" if slo["max_rate"] is None else f"{slo['max_rate']:.1f} q/s"
        notes.append(f"SLO p99 <= {slo['slo_p99_ms']:g} ms: max rate {best} ({len(slo['curve'])} steps)")
    stab = doc.get("stability")
    if stab:
        verdict = "stable" if stab["stable"] else "NOT stable"
        values = ", ".join(f"{w['value_us'] / 1000:.2f}" for w in stab["windows"])
        notes.append(f"stability: {verdict} within {stab['percent']:g}% on p{stab['percentile']:g} after "
                     f"{len(stab['windows'])} windows (ms: {values}); the table merges the last "
                     f"{stab['merged_windows']}")
    lines += notes
    lines += textwrap.wrap("legend: " + LEGEND + (LEGEND_FAILED if failed else ""), width=100, subsequent_indent="  ",
                           break_on_hyphens=False)
    return "\n".join(lines)


#: fewest answered queries for the slowest-1% row: 1,000 put 10 queries in it
ATTRIBUTION_MIN_QUERIES = 1000


def attribution_lines(doc: Mapping[str, Any]) -> list[str]:
    """Where the median and the slowest 1% of queries spent their time (``recpipe.querygen.attribution``):
    each stage's server + hop time, the gateway's own, the client's, as means in ms. Nothing for a run
    with fewer than ``ATTRIBUTION_MIN_QUERIES`` answers, where the slowest 1% are a handful."""
    bands = doc.get("attribution") or {}
    median, tail = bands.get("median"), bands.get("p99")
    if not median or not tail or int(doc.get("ok", 0)) < ATTRIBUTION_MIN_QUERIES:
        return []
    table = _Table(["mean (ms)", *STEPS, "gateway", "client", "end to end"], 14)
    for label, band in (("p45-p55", median), ("slowest 1%", tail)):
        cells = [f"{_ms(st['server_us'])}+{_ms(st['hop_us'])}" for st in (band["stages"][s] for s in STEPS)]
        table.add([f"{label} ({band['queries']})", *cells, _ms(band["gateway_us"]), _ms(band["client_us"]),
                   _ms(band["end_to_end_us"])])
    both = [(s, median["stages"][s]["batch_size"], tail["stages"][s]["batch_size"]) for s in STEPS]
    # (a run of lone queries, batches of one everywhere, needs no such line)
    sizes = [f"{s} {a:.1f} -> {b:.1f}" for s, a, b in both if a and b] if any(
        (a or 1.0) != 1.0 or (b or 1.0) != 1.0 for _, a, b in both) else []
    notes = ["where the time went: the median queries against the slowest 1%; each stage as server+hop (hop = "
             "waiting in the gateway's batched hop, network and (de)serialisation)"]
    if sizes:
        notes.append("mean batch size, median -> slowest 1%: " + ", ".join(sizes))
    if "send_lag_us" in median and "send_lag_us" in tail:  # a document from before it has none
        notes.append(f"of the client's time, the generator's send lag (sent after its scheduled instant): median "
                     f"{_ms(median['send_lag_us'])}, slowest 1% {_ms(tail['send_lag_us'])} ms; the rest is the "
                     "gateway's gRPC receive and send and the network to it")
    wrap = [textwrap.wrap(n, width=100, subsequent_indent="  ", break_on_hyphens=False) for n in notes]
    return ["", *wrap[0], *table.render(), *(line for w in wrap[1:] for line in w)]


def _headline(doc: Mapping[str, Any]) -> str:
    head = f"recpipe querygen: mode {doc['mode']}"
    if doc.get("per_component"):
        head += " (per component)"
    if doc.get("concurrency") and doc["mode"] == "closed":
        head += f", {doc['concurrency']} clients"
    if doc.get("target_rate"):
        head += f", target {doc['target_rate']:.1f} q/s"
    head += f", achieved {doc['achieved_rate']:.1f} q/s, {doc['queries']} queries, {doc['errors']} errors"
    if doc.get("errors_by_code"):
        head += " (" + ", ".join(f"{k}={v}" for k, v in doc["errors_by_code"].items()) + ")"
    if doc.get("started_utc"):
        head += f", {doc['started_utc']}"
    return head


def support_warnings(doc: Mapping[str, Any]) -> list[str]:
    """One line per percentile column that the end-to-end sample (or a stage's) cannot support."""
    n = int(doc["end_to_end"].get("count", doc.get("ok", 0)))
    out = []
    for label, _, p in COLUMNS:
        if not supported(p, n):
            out.append(f"warning: {label} needs at least {min_samples(p):,} samples, this run has {n:,}: "
                       f"shown as '-' (run more queries)")
    return out


def serve_table(rows: Sequence[Mapping[str, Any]], platform: Mapping[str, Any] | None) -> str:
    """``recpipe serve``'s summary: the machine line, then one row per stage process."""
    pipeline = {r.get("stage", r["name"]): r for r in rows}  # a stage's replicas share its device
    lines = [machine_line(platform, pipeline)]
    table = _Table(["stage", "address (host:port)", "pid", "device", "threads (n)", "metrics (url)"], 10,
                   left=(1, 3, 5))
    for r in rows:
        table.add([r["name"], r["address"], str(r.get("pid") or "-"), str(r.get("device") or "?"),
                   str(r.get("threads") if r.get("threads") else "default"), r.get("metrics") or "off"])
    return "\n".join(lines + table.render())
