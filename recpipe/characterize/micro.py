"""The per-stage micro-benchmarks, run through the ``recpipe bench`` modules' own entry points.

Each bench prints its results; the text is captured whole into the document, and the rows of its
timing tables (``recpipe.bench._timing.table``: form, p50 ms, p99 ms, rows/s, speed-up, and the hop
bench's form, p50 µs, p99 µs) and its recall lines are parsed from it, so a report can compare them
form by form.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import time
import traceback
from dataclasses import dataclass
from typing import Any

from recpipe.characterize.settings import Settings

_MS_ROW = re.compile(r"^(?P<form>\S.*?)\s+(?P<p50>[\d.]+)\s+(?P<p99>[\d.]+)\s+(?P<rate>[\d,]+)\s+[\d.]+x$")
_RECALL = re.compile(r"^(?P<what>.*recall@\d+.*?):?\s+(?P<value>[01]\.\d+)$")
_US_ROW = re.compile(r"^(?P<form>\S.*?)\s+(?P<p50>\d+)\s+(?P<p99>\d+)(\s+\(.*\))?$")


@dataclass(frozen=True)
class Bench:
    """One bench run: a name in the document, the ``recpipe.bench`` module, its arguments."""

    name: str
    module: str
    argv: tuple[str, ...]


def plan(settings: Settings) -> list[Bench]:
    s = settings.sizes
    common = ("--models", settings.models, "--data", settings.data)
    # The benches take a thread count (0 = library default); --threads auto has no single answer: 1.
    threads = settings.threads if settings.threads.isdigit() else "1"
    timing = ("--warmup", str(s.bench_warmup))
    out = [Bench(f"ranking batch {b}", "recpipe.bench.ranking",
                 (*common, "--batch", str(b), "--calls", str(s.bench_calls), *timing,
                  "--device", settings.device, "--threads", threads)) for b in s.ranking_batches]
    # --kinds none: every index kind's build, recall and latency at both k are in the bench's print of
    # the train-time record (index.json); building them all again live, once per k, took over ten
    # minutes at full scale (HNSW alone ~2 min): `recpipe bench retrieval --kinds all` does that.
    out += [Bench(f"retrieval k {k}", "recpipe.bench.retrieval",
                  (*common, "--k", str(k), "--queries", str(s.bench_calls), *timing, "--kinds", "none",
                   "--device", settings.device, "--threads", threads)) for k in s.retrieval_ks]
    out.append(Bench(f"features items {settings.num_candidates}", "recpipe.bench.features",
                     (*common, "--items", str(settings.num_candidates), "--queries", str(s.bench_calls), *timing)))
    out.append(Bench(f"hop candidates {settings.num_candidates}", "recpipe.bench.hop",
                     ("--calls", str(s.hop_calls), "--warmup", str(max(s.hop_calls // 10, 1)),
                      "--candidates", str(settings.num_candidates), "--workers", str(settings.workers),
                      # and after 5 ms idle: what waking idle processes costs each hop of a lone query here
                      "--idle-calls", str(max(s.hop_calls // 4, 10)), "--idle-ms", "5")))
    return out


def parse_rows(text: str) -> list[dict[str, Any]]:
    """The timing rows a bench printed, as ``{form, p50_ms, p99_ms[, rows_per_s]}``."""
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        if m := _MS_ROW.match(line.rstrip()):
            rows.append({"form": m["form"].strip(), "p50_ms": float(m["p50"]), "p99_ms": float(m["p99"]),
                         "rows_per_s": float(m["rate"].replace(",", ""))})
        elif (m := _US_ROW.match(line.rstrip())) and not line.startswith(" "):
            rows.append({"form": m["form"].strip(), "p50_ms": int(m["p50"]) / 1000, "p99_ms": int(m["p99"]) / 1000})
    return rows


def parse_recalls(text: str) -> list[dict[str, Any]]:
    """The recall lines a bench printed (retrieval: served index vs exact, fp16/bf16 vs fp32), as
    ``{what, recall}``."""
    return [{"what": m["what"].strip(), "recall": float(m["value"])}
            for line in text.splitlines() if (m := _RECALL.match(line.strip()))]


def run_one(bench: Bench) -> dict[str, Any]:
    """Run ``bench``, capturing what it prints; an error is recorded, not raised."""
    module = importlib.import_module(bench.module)
    parser = argparse.ArgumentParser(prog=bench.module)
    module.add_arguments(parser)
    args = parser.parse_args(list(bench.argv))
    args.nvtx = False
    buf = io.StringIO()
    t0 = time.perf_counter()
    rc: int | None = None
    error = ""
    try:
        with contextlib.redirect_stdout(buf):
            rc = int(module.run(args))
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        buf.write(traceback.format_exc(limit=3))
    text = buf.getvalue()
    return {"name": bench.name, "command": "recpipe bench " + bench.module.rsplit(".", 1)[1].replace("_", "-")
            + " " + " ".join(bench.argv), "rc": rc, "error": error, "elapsed_s": round(time.perf_counter() - t0, 2),
            "rows": parse_rows(text), "recalls": parse_recalls(text), "stdout": text}
