"""Runs side by side: per-stage latency of each run and its speed-up over the first (the baseline).

Speed-up is ``baseline latency / run latency`` at the same percentile: 2.0x means the run takes half
the time; below 1.0x it is slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from recpipe.config import STAGES

ROWS: tuple[str, ...] = ("end_to_end", *STAGES)


def _block(doc: dict[str, Any], row: str) -> dict[str, Any]:
    return doc["end_to_end"] if row == "end_to_end" else doc["stages"][row]


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
    e2e = speedup(base["end_to_end"][key], run["end_to_end"][key])
    pct = key.removesuffix("_us").replace("p999", "p99.9")
    if e2e is None:
        head = f"{label}: end to end n/a ({pct})"
    elif e2e >= 1:
        head = f"{label} is {e2e:.2f}x faster end to end ({pct})"
    else:
        head = f"{label} is {1 / e2e:.2f}x slower end to end ({pct})"
    parts = [f"{s} {_x(speedup(base['stages'][s][key], run['stages'][s][key]))}" for s in STAGES]
    return head + "; " + "; ".join(parts)


def _describe(doc: dict[str, Any]) -> dict[str, str]:
    plat = doc.get("platform") or {}
    mode = doc.get("mode", "?")
    if doc.get("per_component"):
        mode += " (per component)"
    if doc.get("target_rate"):
        mode += f" @ {doc['target_rate']:.0f} q/s"
    elif doc.get("concurrency") and doc.get("mode") == "closed":
        mode += f" x{doc['concurrency']}"
    devices = ", ".join(f"{name}: {info.get('device')}" for name, info in (doc.get("pipeline") or {}).items()
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


def markdown(runs: Sequence[tuple[str, dict[str, Any]]], charts: Sequence[str] = ()) -> str:
    """The report: what was compared, a latency table with speed-ups, and one verdict line per run."""
    labels = [label for label, _ in runs]
    base_label, base = runs[0]
    out = ["# recpipe latency report", ""]
    out += ["| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(runs)]
    described = [_describe(doc) for _, doc in runs]
    for key in described[0]:
        out.append(f"| {key} | " + " | ".join(d[key].replace("|", "/") for d in described) + " |")
    out += ["", f"Latency in ms; speed-up is relative to **{base_label}** (higher is faster).", ""]
    header = "| stage | " + " | ".join(f"{lb} p50 | {lb} p99" for lb in labels)
    header += "".join(f" | {lb} speed-up p50 | {lb} speed-up p99" for lb in labels[1:]) + " |"
    out += [header, "|---" * (1 + 2 * len(runs) + 2 * (len(runs) - 1)) + "|"]
    for row in ROWS:
        cells = []
        for _, doc in runs:
            b = _block(doc, row)
            cells += [_ms(b["p50_us"]), _ms(b["p99_us"])]
        for _, doc in runs[1:]:
            for key in ("p50_us", "p99_us"):
                cells.append(_x(speedup(_block(base, row)[key], _block(doc, row)[key])))
        name = "**end to end**" if row == "end_to_end" else row
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    if len(runs) > 1:
        out.append("")
        for label, doc in runs[1:]:
            out.append(f"- {verdict(label, base, doc, 'p50_us')}")
            out.append(f"- {verdict(label, base, doc, 'p99_us')}")
    if charts:
        out.append("")
        out += [f"![{c}]({c})" for c in charts]
    return "\n".join(out) + "\n"
