"""Runs side by side: per-stage latency of each run and its speed-up over the first (the baseline).

Speed-up is ``baseline latency / run latency`` at the same percentile: 2.0x means the run takes half
the time; below 1.0x it is slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from recpipe.config import STEPS
from recpipe.querygen.table import min_samples, supported
from recpipe.stages import REGISTRY

ROWS: tuple[str, ...] = (*STEPS, "end_to_end")


#: what two runs must share for their latencies to be comparable: (label, how to read it from a run)
_LIKE_FOR_LIKE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mode", ("mode",)),
    ("per-component", ("per_component",)),
    ("closed-loop clients", ("concurrency",)),
    ("users", ("workload", "users")),
    ("zipf exponent", ("workload", "zipf_exponent")),
    ("candidates", ("workload", "candidates")),
    ("results", ("workload", "num_results")),
    # a deadline caps the tail: every query slower than it fails, and ends at it
    ("deadline (s)", ("workload", "timeout_s")),
)


def _get(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = doc
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _arrivals(doc: dict[str, Any]) -> str:
    """How an open loop's queries arrived: Poisson, or replayed intervals (by their count and mean rate, not
    the file's path, which another machine names differently). A burst replayed at the same mean rate is
    another load: its queue, and tail, differ."""
    replay = _get(doc, ("workload", "arrivals"))
    if doc.get("mode") != "open":
        return "-"
    if not isinstance(replay, dict):
        return "Poisson"
    return f"replayed ({replay.get('intervals')} intervals, mean {replay.get('mean_rate')} q/s)"


def differences(base: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """How ``run`` differs from ``base`` in mode or workload (empty: a speed-up between them means
    something). Open-loop runs must also offer the same rate, unless both are SLO searches (then the
    max rate is the result being compared)."""
    out = []
    for label, path in _LIKE_FOR_LIKE:
        a, b = _get(base, path), _get(run, path)
        if path == ("concurrency",) and base.get("mode") != "closed":
            continue
        if a != b:
            out.append(f"{label} {a!r} vs {b!r}")
    a, b = _arrivals(base), _arrivals(run)
    if a != b:
        out.append(f"arrivals {a} vs {b}")
    if (base.get("mode") == run.get("mode") == "open" and not (base.get("slo") and run.get("slo"))
            and base.get("target_rate") != run.get("target_rate")):
        out.append(f"offered rate {base.get('target_rate')} vs {run.get('target_rate')} q/s")
    return out


def block(doc: dict[str, Any], row: str) -> dict[str, Any]:
    """A run's latencies for ``row``: a stage's (answered queries), or end to end over every query, the
    failed ones to their deadline or failure (``end_to_end_all``; a document from before it, the answered ones): a
    run whose slowest queries ran into their deadline must not read as fast."""
    if row != "end_to_end":
        return doc["stages"][row]
    every: dict[str, Any] | None = doc.get("end_to_end_all")
    return every if every else doc["end_to_end"]


def failure_notes(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """One line per run with failed queries: how many, by code, and what its end-to-end row counts."""
    out = []
    for label, doc in runs:
        if not doc.get("errors"):
            continue
        codes = ", ".join(f"{k}={v}" for k, v in (doc.get("errors_by_code") or {}).items())
        counted = ("end to end counts each as unanswered until its deadline or its failure, whichever came later (the "
                    "stages' rows: the answered queries)"
                   if doc.get("end_to_end_all") else "its latencies leave them out (a document without "
                   "end_to_end_all): its tail may be cut off by its deadline")
        out.append(f"**{label}: {doc['errors']} of {doc.get('queries', '?')} queries failed** ({codes}); {counted}.")
    return out


#: below this a latency is timer noise, and a ratio of two of them means nothing
MIN_US = 10.0


def speedup(base_us: float, run_us: float) -> float | None:
    """``base / run``; None when either is under ``MIN_US`` (no samples, or a stage that takes no time)."""
    if base_us < MIN_US or run_us < MIN_US:
        return None
    return base_us / run_us


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}" if us < 1000 else f"{us / 1000:.2f}"


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def verdict(label: str, base: dict[str, Any], run: dict[str, Any], key: str = "p50_us") -> str:
    """e.g. ``"B is 1.23x faster end to end (p50); augment_user 1.00x; ...; rank 1.02x"``."""
    e2e = speedup(block(base, "end_to_end")[key], block(run, "end_to_end")[key])
    pct = key.removesuffix("_us").replace("p999", "p99.9")
    if e2e is None:
        head = f"{label}: end to end n/a ({pct})"
    elif e2e >= 1:
        head = f"{label} is {e2e:.2f}x faster end to end ({pct})"
    else:
        head = f"{label} is {1 / e2e:.2f}x slower end to end ({pct})"
    p = {"p50_us": 50.0, "p90_us": 90.0, "p95_us": 95.0, "p99_us": 99.0, "p999_us": 99.9}.get(key)
    fewest = min(int(block(d, "end_to_end").get("count") or 0) for d in (base, run))
    if p is not None and not supported(p, fewest):
        head += f" (from {fewest:,} queries: {pct} needs {min_samples(p):,})"
    parts = [f"{s} {_x(speedup(base['stages'][s][key], run['stages'][s][key]))}" for s in STEPS]
    return head + "; " + "; ".join(parts)


def _chain_order(pipeline: dict[str, Any]) -> list[tuple[str, Any]]:
    """A run's stages (``pipeline``: name -> GetInfo) in the registry's order, upstream first (features,
    retrieval, ranking, gateway), any others after: a run records them as its probes answered."""
    order = {name: i for i, name in enumerate(REGISTRY.names)}
    return sorted(pipeline.items(), key=lambda item: order.get(item[0], len(order)))


def _describe(doc: dict[str, Any]) -> dict[str, str]:
    plat = doc.get("platform") or {}
    mode = doc.get("mode", "?")
    if doc.get("per_component"):
        mode += " (per component)"
    if doc.get("target_rate"):
        mode += f" @ {doc['target_rate']:.0f} q/s"
    elif doc.get("concurrency") and doc.get("mode") == "closed":
        mode += f" x{doc['concurrency']}"
    devices = ", ".join(f"{name}: {info.get('device')}" for name, info in _chain_order(doc.get("pipeline") or {})
                        if isinstance(info, dict) and info.get("device"))
    return {
        "cpu": f"{plat.get('cpu', '?')} ({plat.get('cores', '?')} cores)",
        "gpu": str(plat.get("gpu", "?")),
        "stage devices": devices or "?",
        "model version": str(doc.get("model_version") or "?"),
        "mode": mode,
        "queries (errors)": f"{doc.get('queries', '?')} ({doc.get('errors', '?')})",
        "achieved rate": f"{doc.get('achieved_rate', 0):.1f} q/s",
        "SLO max rate": ("-" if not doc.get("slo") else
                         f"{doc['slo']['max_rate'] or 0:.1f} q/s @ p99 <= {doc['slo']['slo_p99_ms']:g} ms"),
    }


def markdown(runs: Sequence[tuple[str, dict[str, Any]]], charts: Sequence[str] = (),
             unlike: Sequence[str] = ()) -> str:
    """The report: what was compared, a latency table with speed-ups, and one verdict line per run.

    ``unlike`` lists how the runs differ in mode or workload (``--force`` compared them anyway); the
    report then says so above the speed-ups.
    """
    labels = [label for label, _ in runs]
    base_label, base = runs[0]
    out = ["# recpipe latency report", ""]
    if unlike:
        out += ["**Warning: these runs differ in mode or workload, so the speed-ups compare unlike things "
                "(compared anyway with --force):** " + "; ".join(unlike), ""]
    out += ["| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(runs)]
    described = [_describe(doc) for _, doc in runs]
    for key in described[0]:
        out.append(f"| {key} | " + " | ".join(d[key].replace("|", "/") for d in described) + " |")
    out += ["", f"Latency in ms; speed-up is relative to **{base_label}** (higher is faster).", ""]
    header = "| stage | " + " | ".join(f"{lb} p50 | {lb} p99" for lb in labels)
    header += "".join(f" | {lb} speed-up p50 | {lb} speed-up p99" for lb in labels[1:]) + " |"
    out += [header, "|---" * (1 + 2 * len(runs) + 2 * (len(runs) - 1)) + "|"]
    def mark(b: dict[str, Any], p: float) -> str:  # a percentile its sample cannot support is its largest value
        return "" if supported(p, int(b.get("count") or 0)) else "*"

    short = False
    for row in ROWS:
        cells = []
        for _, doc in runs:
            b = block(doc, row)
            cells += [_ms(b["p50_us"]) + mark(b, 50.0), _ms(b["p99_us"]) + mark(b, 99.0)]
            short = short or bool(mark(b, 99.0))
        for _, doc in runs[1:]:
            for key, p in (("p50_us", 50.0), ("p99_us", 99.0)):
                flag = mark(block(base, row), p) or mark(block(doc, row), p)
                cells.append(_x(speedup(block(base, row)[key], block(doc, row)[key])) + flag)
        name = "**end to end** (client)" if row == "end_to_end" else row
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    if short:
        out += ["", f"\\* from fewer than {min_samples(99.0)} queries: a p99 there is the slowest of them, not a "
                "percentile (run more queries)."]
    failures = failure_notes(runs)
    out += [*(["", *failures] if failures else []), "", *split_table(runs)]
    out += attribution_table(runs)
    if len(runs) > 1:
        out.append("")
        for label, doc in runs[1:]:
            out.append(f"- {verdict(label, base, doc, 'p50_us')}")
            out.append(f"- {verdict(label, base, doc, 'p99_us')}")
    if charts:
        out.append("")
        out += [f"![{c}]({c})" for c in charts]
    return "\n".join(out) + "\n"


def split_table(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Queue vs compute per stage (p50, ms) and the mean batch size, for runs whose stages report them."""
    def reported(doc: dict[str, Any], stage: str) -> bool:
        return bool(((doc["stages"][stage].get("batch_size") or {}).get("count") or 0) > 0)

    if not any(reported(doc, s) for _, doc in runs for s in STEPS):
        return ["Queue/compute split: no run reports it (its stages send StageTiming.queue_us/compute_us = 0)."]
    labels = [label for label, _ in runs]
    out = ["Server time split by each stage's batcher (p50, ms; batch = mean requests per core call):", "",
           "| stage | " + " | ".join(f"{lb} queue p50 | {lb} compute p50 | {lb} batch" for lb in labels) + " |",
           "|---" * (1 + 3 * len(runs)) + "|"]
    for stage in STEPS:
        cells = []
        for _, doc in runs:
            if reported(doc, stage):
                b = doc["stages"][stage]
                cells += [_ms(b["queue"]["p50_us"]), _ms(b["compute"]["p50_us"]), f"{b['batch_size']['mean']:.2f}"]
            else:
                cells += ["-", "-", "-"]
        out.append(f"| {stage} | " + " | ".join(cells) + " |")
    return out


def attribution_table(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Where the median and the slowest 1% of each run's queries spent their time (mean ms of each part,
    ``recpipe.querygen.attribution``), for runs that carry it (empty if none does)."""
    have = [(label, doc["attribution"]) for label, doc in runs
            if (doc.get("attribution") or {}).get("median") and doc["attribution"].get("p99")]
    if not have:
        return []
    rows: list[tuple[str, Any]] = [
        *((f"{stage} {part}", (lambda band, s=stage, k=f"{part}_us": band["stages"][s][k]))
          for stage in STEPS for part in ("server", "hop")),
        ("gateway", lambda band: band["gateway_us"]), ("client", lambda band: band["client_us"]),
        ("of it: send lag", lambda band: band.get("send_lag_us")),
        ("**end to end**", lambda band: band["end_to_end_us"])]
    out = ["", "Where the time went: the mean of each part of the median queries (p45-p55) and of the slowest 1% "
           "(ms; hop = waiting in the gateway's batched hop, network and (de)serialisation):", "",
           "| part | " + " | ".join(f"{lb} median | {lb} slowest 1%" for lb, _ in have) + " |",
           "|---" * (1 + 2 * len(have)) + "|"]
    for name, get in rows:
        def cell(us: float | None) -> str:
            return "-" if us is None else _ms(us)  # a part a run's document predates

        out.append(f"| {name} | " + " | ".join(f"{cell(get(a['median']))} | {cell(get(a['p99']))}" for _, a in have)
                   + " |")
    out.append("| queries | " + " | ".join(f"{a['median']['queries']} | {a['p99']['queries']}" for _, a in have) + " |")
    return out
