"""The tables of BENCHMARKS.md that quote the characterization documents under benchmarks/.

Each directory ``benchmarks/NAME/`` holds one ``recpipe characterize`` document
(``characterization.json``), its report (``report/``) and ``about.json``: the machine in words, the
commit it ran at and the exact commands. BENCHMARKS.md marks every table it quotes from them:

    <!-- table: KIND NAME [NAME ...] -->
    ... the table as ``render(KIND, [NAME, ...])`` writes it ...
    <!-- end table -->

``python benchmarks/tables.py`` rewrites every marked table from the documents (after a run is added
or replaced); ``python benchmarks/tables.py --check`` says which differ. ``tests/unit/test_benchmarks.py``
fails while one does. ``python benchmarks/tables.py --reports`` (re)writes each directory's ``report/``
with the writer ``recpipe characterize`` uses (for a document measured elsewhere and copied in).
The tables need only the standard library; the reports need recpipe.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PAGE = HERE.parent / "BENCHMARKS.md"
STEPS = ("augment_user", "retrieve", "augment_items", "rank")
BLOCK = re.compile(r"<!-- table: ([a-z-]+)((?: [\w.-]+)+) -->\n(.*?)<!-- end table -->", re.S)


class Run:
    """One reference characterization: its document and what ``about.json`` says of it."""

    def __init__(self, name: str, root: Path = HERE) -> None:
        self.name = name
        self.doc: dict[str, Any] = json.loads((root / name / "characterization.json").read_text(encoding="utf-8"))
        self.about: dict[str, Any] = json.loads((root / name / "about.json").read_text(encoding="utf-8"))
        self.sections: dict[str, Any] = self.doc["sections"]

    @property
    def date(self) -> str:
        return str(self.doc["started_utc"])[:10]

    def bench(self, name: str) -> dict[str, Any] | None:
        for b in (self.sections.get("micro") or {}).get("benches", []):
            if b["name"] == name and not b.get("error"):
                return dict(b)
        return None

    def skipped(self, name: str) -> bool:
        return name in (self.sections.get("micro") or {}).get("skipped_for_budget", [])

    def row(self, bench: str, form: str) -> dict[str, Any] | None:
        b = self.bench(bench)
        return next((r for r in b["rows"] if r["form"] == form), None) if b else None

    def recall(self, bench: str, what: str) -> float | None:
        b = self.bench(bench)
        return next((r["recall"] for r in b.get("recalls", []) if r["what"] == what), None) if b else None

    def missing(self, bench: str) -> str:
        return "not run (budget)" if self.skipped(bench) else "-"


def ms(v: float | None) -> str:
    """Milliseconds at the precision the figure deserves: 3 significant digits, at least 2 decimals
    below 10 ms."""
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def us(v: float | None) -> str:
    return "-" if v is None else ms(v / 1000)


def _seq(run: Run) -> dict[str, Any] | None:
    return run.sections.get("sequential")


def _e2e(run: Run) -> str:
    s = _seq(run)
    return "-" if not s else f"{us(s['end_to_end']['p50_us'])} / {us(s['end_to_end']['p99_us'])}"


def _stage(step: str) -> Callable[[Run], str]:
    def cell(run: Run) -> str:
        s = _seq(run)
        if not s:
            return "-"
        st = s["stages"][step]
        return f"{us(st['p50_us'])} / {us(st['server']['p50_us'])}"
    return cell


def _network(run: Run) -> str:
    s = _seq(run)
    if not s:
        return "-"
    return us(sum(max(s["stages"][st]["mean_us"] - s["stages"][st]["server"]["mean_us"], 0.0) for st in STEPS))


def _cpu(run: Run) -> str:
    s = _seq(run)
    if not s:
        return "-"
    cpu = s["cpu_s_per_query"]
    return " / ".join("-" if cpu.get(p) is None else f"{cpu[p] * 1000:.2f}"
                      for p in ("features", "retrieval", "ranking", "gateway", "querygen"))


def _peak(run: Run) -> str:
    sw = run.sections.get("sweep")
    if not sw or not sw.get("peak_throughput"):
        return "-"
    p = next(p for p in sw["points"] if p["concurrency"] == sw["peak_concurrency"])
    return f"{sw['peak_throughput']:.0f} q/s at {sw['peak_concurrency']} clients (p99 {us(p['p99_us'])} ms)"


def _slo(bound: float) -> Callable[[Run], str]:
    def cell(run: Run) -> str:
        slo = run.sections.get("slo")
        found = {s["p99_bound_ms"]: s["max_rate"] for s in (slo or {}).get("searches", [])}
        if bound not in found:
            return "not searched"
        r = found[bound]
        return "none met" if r is None else f"{r:.0f}"
    return cell


def _gpu_busy(run: Run) -> str:
    sweep = run.sections.get("sweep") or {}
    busy = sweep.get("gpu_busy") or {}
    if not busy.get("measured"):
        return "-"
    peak = sweep.get("peak_gpu_busy")
    return f"{busy['busy_fraction']:.2f}" + (f" ({peak:.2f} at the peak)" if peak is not None else "")


def _served(run: Run) -> str:
    s = _seq(run)
    if not s:
        return "-"
    r, k = s["pipeline"]["ranking"]["details"], s["pipeline"]["retrieval"]["details"]
    return f"ranking {r.get('precision', '?')}; retrieval {k.get('index_type', '?')}"


def _rank_batch(b: int) -> Callable[[Run], str]:
    def cell(run: Run) -> str:
        r = run.row("ranking batched", f"served, batch {b} x 500")
        return run.missing("ranking batched") if r is None else ms(r["per_query_ms"])
    return cell


def _retrieval(run: Run) -> str:
    served, exact = run.row("retrieval k 500", "served index k=500"), run.row("retrieval k 500", "exact (faiss flat) k=500")
    recall = run.recall("retrieval k 500", "served recall@500 vs exact on these queries")
    if served is None or exact is None:
        return run.missing("retrieval k 500")
    return f"{ms(served['p50_ms'])} / {ms(exact['p50_ms'])} (recall@500 {recall:.3f})"


def _features(run: Run) -> str:
    g, n = run.row("features items 500", "augment_items gather k=500"), run.row("features items 500", "augment_items naive k=500")
    return run.missing("features items 500") if g is None or n is None else f"{ms(g['p50_ms'])} / {ms(n['p50_ms'])}"


def _hop(run: Run) -> str:
    e, h = run.row("hop candidates 500", "bare grpc.aio echo"), run.row("hop candidates 500", "recpipe ranking stage (Rank)")
    return run.missing("hop candidates 500") if e is None or h is None else f"{ms(e['p50_ms'])} / {ms(h['p50_ms'])}"


def _bounds(runs: list[Run]) -> list[float]:
    return sorted({s["p99_bound_ms"] for r in runs for s in (r.sections.get("slo") or {}).get("searches", [])})


def _header(runs: list[Run]) -> list[str]:
    return ["| | " + " | ".join(f"`{r.name}`" for r in runs) + " |", "|---" * (1 + len(runs)) + "|"]


def summary(runs: list[Run]) -> list[str]:
    rows: list[tuple[str, Callable[[Run], str]]] = [
        ("served forms (ranking precision; retrieval index)", _served),
        ("sequential, end to end p50 / p99 (ms)", _e2e),
        *[(f"{s} p50: seen by the gateway / in the stage (ms)", _stage(s)) for s in STEPS],
        ("network, gateway to stages, 4 hops (mean ms)", _network),
        ("CPU ms per query: features / retrieval / ranking / gateway / querygen", _cpu),
        ("peak closed loop", _peak),
        *[(f"highest rate with p99 ≤ {b:g} ms (q/s)", _slo(b)) for b in _bounds(runs)],
        ("GPU busy over the sweep (at its peak, where sampled per point)", _gpu_busy),
        ("rank 1 × 500 in process, fp32 (ms)", _rank_batch(1)),
        ("rank 32 × 500 in process, fp32, per query (ms)", _rank_batch(32)),
        ("retrieve k = 500 in process: served / exact flat (ms)", _retrieval),
        ("augment_items of 500 rows: gather / filter Polars per request (ms)", _features),
        ("one hop of 500 candidates: bare grpc.aio echo / recpipe Rank (ms)", _hop),
    ]
    return _header(runs) + [f"| {label} | " + " | ".join(f(r) for r in runs) + " |" for label, f in rows]


def machine(runs: list[Run]) -> list[str]:
    """Where each document comes from: the machine, the commit, the date and the exact commands."""
    out = []
    for r in runs:
        s = r.doc["settings"]
        plat = r.sections.get("platform") or {}
        libs = plat.get("libraries") or {}
        lib = ", ".join(f"{k} {libs[k]}" for k in ("torch", "faiss-cpu", "grpcio", "polars") if k in libs)
        notes = f" {r.about['notes']}" if r.about.get("notes") else ""
        out.append(f"- **`{r.name}`**: {r.about['machine']}. Commit {r.about['commit']}, {r.date}; "
                   f"Python {plat.get('python', '?')}, {lib}. Data scale {s['data_scale']:g}, seed {s['data_seed']}; "
                   f"device {s['device']}, threads {s['threads']}.{notes}")
        out += ["  ```", *(f"  {c}" for c in r.about["commands"]), "  ```"]  # a tight list: no blank lines
    return out


def _caption(runs: list[Run], bench: str) -> list[str]:
    out = []
    for r in runs:
        b = r.bench(bench)
        how = f"`{b['command']}`" if b and b["command"].startswith("recpipe") else \
            f"{b['command']}" if b else "not run"
        out.append(f"- `{r.name}` ({r.about['short']}, {r.about['commit']}, {r.date}): {how}, in "
                   f"`recpipe characterize`'s micro-benchmarks")
    return out


def ranking_batches(runs: list[Run]) -> list[str]:
    """Per-query cost of a ranking core call over B queries of 500 candidates: what batching buys."""
    forms = ("served", "no CUDA graphs")
    cols = [(r, f) for r in runs for f in forms if r.row("ranking batched", f"{f}, batch 1 x 500")]
    out = [*_caption(runs, "ranking batched"), ""]
    out += ["| queries per call | " + " | ".join(f"`{r.name}` {f}" for r, f in cols) + " |",
            "|---" * (1 + len(cols)) + "|"]
    for b in (1, 2, 4, 8, 16, 32):
        cells = []
        for r, f in cols:
            row = r.row("ranking batched", f"{f}, batch {b} x 500")
            cells.append("-" if row is None else ms(row["per_query_ms"]))
        out.append(f"| {b} × 500 (ms per query) | " + " | ".join(cells) + " |")
    return out


_PRECISION = re.compile(r"^(fp32|bf16|int8)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)\s+([+-][\d.]+)\s*$", re.M)


def ranking_precision(runs: list[Run]) -> list[str]:
    """The CPU ranking forward in each precision, 1 × 500 (or 1 × 100 where 500 did not run), beside
    its held-out AUC loss, and what ``auto`` chose at the stage's start-up."""
    out: list[str] = []
    rows = []
    for r in runs:
        bench = next((n for n in ("ranking batch 500", "ranking batch 100") if r.bench(n)), None)
        b = r.bench(bench) if bench else None
        out += _caption([r], bench or "ranking batch 500")
        found = {m[0]: m for m in _PRECISION.findall(b["stdout"])} if b else {}
        choice = (_seq(r) or {}).get("pipeline", {}).get("ranking", {}).get("details", {}).get("precision", "?")
        isa = (_seq(r) or {}).get("pipeline", {}).get("ranking", {}).get("details", {}).get("cpu_isa", "?")
        cells = []
        for p in ("fp32", "bf16", "int8"):
            m = found.get(p)
            cells.append("-" if m is None else f"{ms(float(m[1]))} ({m[4]})")
        size = (bench or "").rsplit(" ", 1)[-1]
        rows.append(f"| `{r.name}` | {isa} | 1 × {size} | " + " | ".join(cells) + f" | {choice} |")
    out += ["", "| document | CPU ISA (torch) | rows | fp32 p50 ms (dAUC) | bf16 compiled | int8 dynamic | `auto` served |",
            "|---|---|---|---|---|---|---|", *rows]
    return out


_KIND = re.compile(r"^(flat|ivf|ivfsq8|ivfpqfs|hnsw)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.M)


def index_kinds(runs: list[Run]) -> list[str]:
    """Every index kind ``recpipe train`` built and tuned at k = 500, as the retrieval bench prints the
    training record, and the kind ``auto`` chose."""
    out = [*_caption(runs, "retrieval k 500"), ""]
    out += ["| document | kind | build s | MB | recall@500 | p50 at k = 500 (ms) |", "|---|---|---|---|---|---|"]
    for r in runs:
        b = r.bench("retrieval k 500")
        chosen = ((_seq(r) or {}).get("pipeline", {}).get("retrieval", {}).get("details", {})
                  .get("trained_index_type"))
        for m in _KIND.findall(b["stdout"]) if b else []:
            kind = f"**{m[0]}** (`auto`)" if m[0] == chosen else m[0]
            out.append(f"| `{r.name}` | {kind} | {float(m[1]):.1f} | {float(m[2]):.0f} | {float(m[4]):.4f} | "
                       f"{ms(float(m[6]))} |")
    return out


def gpu_retrieval(runs: list[Run]) -> list[str]:
    """Exact retrieval on the GPU in half precision, with and without the fp32 re-score, at k = 500."""
    out = [*_caption(runs, "retrieval k 500"), ""]
    out += ["| document | form | p50 ms | recall@500 vs fp32 exact |", "|---|---|---|---|"]
    forms = (("torch fp16", "fp16 exact search alone: recall@500 vs fp32 exact"),
             ("torch fp16 + re-score x2", "fp16 exact search + fp32 re-score of top 2k: recall@500 vs fp32 exact"),
             ("torch bf16", "bf16 exact search alone: recall@500 vs fp32 exact"),
             ("torch bf16 + re-score x2", "bf16 exact search + fp32 re-score of top 2k: recall@500 vs fp32 exact"),
             ("served index k=500", "served recall@500 vs exact on these queries"))
    for r in runs:
        for form, what in forms:
            row, rec = r.row("retrieval k 500", form), r.recall("retrieval k 500", what)
            if row is not None:
                out.append(f"| `{r.name}` | {form} | {ms(row['p50_ms'])} | {'-' if rec is None else f'{rec:.4f}'} |")
    return out


KINDS: dict[str, Callable[[list[Run]], list[str]]] = {
    "machine": machine,
    "summary": summary,
    "ranking-batches": ranking_batches,
    "ranking-precision": ranking_precision,
    "index-kinds": index_kinds,
    "gpu-retrieval": gpu_retrieval,
}


def render(kind: str, names: list[str], root: Path = HERE) -> str:
    return "\n".join(KINDS[kind]([Run(n, root) for n in names])) + "\n"


def blocks(text: str) -> list[tuple[str, list[str], str]]:
    """Every marked table in ``text``: (kind, document names, the table as written)."""
    return [(m[1], m[2].split(), m[3]) for m in BLOCK.finditer(text)]


def rewrite(text: str, root: Path = HERE) -> str:
    return BLOCK.sub(lambda m: f"<!-- table: {m[1]}{m[2]} -->\n{render(m[1], m[2].split(), root)}<!-- end table -->",
                     text)


def names(root: Path = HERE) -> list[str]:
    """The reference directories: those holding a characterization."""
    return sorted(p.parent.name for p in root.glob("*/characterization.json"))


def write_reports(root: Path = HERE) -> None:
    from recpipe.characterize import document, report

    for name in names(root):
        report.write(document.load(root / name), root / name / "report")
        print(f"wrote {name}/report")


def main(argv: list[str]) -> int:
    if "--reports" in argv:
        write_reports()
        return 0
    text = PAGE.read_text(encoding="utf-8")
    new = rewrite(text)
    if "--check" in argv:
        stale = [f"{k} {' '.join(n)}" for k, n, body in blocks(text) if render(k, n) != body]
        for s in stale:
            print(f"differs from the documents: {s}")
        return 1 if stale else 0
    if new != text:
        PAGE.write_text(new, encoding="utf-8")
        print(f"rewrote {PAGE.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
