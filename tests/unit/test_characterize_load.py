"""What a characterization's report says a run kept busy, and which resource it names as the limit
(recpipe.characterize.load), and how much of each stage's CPU was its own computing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from recpipe.characterize import compare, load, report


def _load(machine: float | None, **cores: float) -> dict[str, Any]:
    processes = {"gateway": 4, "ranking": 2, "querygen": 1}
    return {"machine_busy": machine, "cores": cores, "processes": {k: processes.get(k, 1) for k in cores}}


def test_the_busiest_group_is_the_one_with_most_cores_per_process() -> None:
    # the gateway's four replicas use more cores together, but each of ranking's two uses more
    assert load.busiest(_load(0.5, gateway=2.4, ranking=1.9, querygen=0.3)) == ("ranking", 0.95, 2)
    assert load.busiest(_load(0.5, gateway=None)) is None  # type: ignore[arg-type]


def test_the_machine_then_a_process_then_the_gpu_is_named_the_limit() -> None:
    assert load.describe(_load(0.99, gateway=2.0, ranking=0.8)) == (
        "machine 99% busy (all cores); busiest process: gateway at 0.50 cores each (4 processes): "
        "the machine's cores were the limit.")
    assert load.describe(_load(0.64, gateway=3.9, ranking=0.8), gpu_busy=0.3) == (
        "machine 64% busy (all cores); busiest process: gateway at 0.97 cores each (4 processes); GPU 30% busy: "
        "gateway's own thread was the likely limit (a Python thread holds one core at most).")
    assert load.describe(_load(0.6, ranking=5.0)).endswith(  # 2.5 cores each: not one thread's cap
        "busiest process: ranking at 2.50 cores each (2 processes): ranking ran several busy threads: their number "
        "was the likely limit.")
    assert load.describe(_load(0.4, querygen=0.5), gpu_busy=0.93).endswith("GPU 93% busy: the GPU was the limit.")
    assert load.describe(_load(0.2, querygen=0.3)) == (
        "machine 20% busy (all cores); busiest process: querygen at 0.30 cores: "
        "nothing was saturated: the time went to waiting (hops, batches, the clients).")
    assert load.describe(_load(None, querygen=0.3)).startswith("machine load not readable; ")
    assert load.describe(None) == load.describe({}) == ""  # a document from before loads were recorded


def test_the_report_sets_each_stages_own_computing_against_its_process_cpu() -> None:
    cpu = {"features": 0.0024, "ranking": 0.0048, "gateway": 0.0033, "querygen": 0.001}
    own = {"features": 0.0008, "ranking": 0.0036}  # the gateway has no core: it reports none
    assert report.own_work("At the peak", cpu, own) == (
        "At the peak, the stages' own computing (their core calls' CPU, ms per query, of all their process's): "
        "features 0.80 of 2.40 (33%), ranking 3.60 of 4.80 (75%); the rest of each is serving the calls (gRPC, "
        "asyncio, decoding and encoding, batching, health).")
    # a stage whose library runs several threads: only the core call's own thread is counted, a floor
    seq = {"pipeline": {"features": {"threads": 1}, "ranking": {"threads": 9}, "gateway": {"threads": 1}}}
    assert "ranking 3.60 of 4.80 (75%; its calling thread only, of 9 threads)" in str(
        report.own_work("Sequential", cpu, own, report.threads(seq)))
    # a document from before the split (or a stage unreadable): nothing said
    assert report.own_work("Sequential", cpu, None) is None
    assert report.own_work("Sequential", cpu, {"ranking": None}) is None


def test_the_sweep_table_has_a_machine_column_only_where_the_runs_recorded_their_load() -> None:
    bench = Path(__file__).resolve().parents[2] / "benchmarks"

    def sweep_header(name: str) -> str:
        doc = json.loads((bench / name / "characterization.json").read_text(encoding="utf-8"))
        return next(line for line in report.markdown(doc, charts=()).splitlines() if line.startswith("| clients |"))

    assert sweep_header("h200-cuda-df50554").endswith("| CPU ms/q querygen | machine busy |")
    assert sweep_header("h200-cuda-1693ac7").endswith("| CPU ms/q querygen |")  # measured before loads were


def test_a_bound_no_rate_met_is_set_against_the_lowest_rates_tail_and_the_sequential_one() -> None:
    doc = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "h200-cuda-df50554" /
                      "characterization.json").read_text(encoding="utf-8"))
    assert ("p99 <= 10 ms: no rate met it. Its lowest p99 was 10.83 ms, at 238.8 q/s; at the lowest rate tried, "
            "29.9 q/s (1% of the sweep's peak), it was 12.76 ms (sequential: 11.13 ms): the bound is under this "
            "chain's tail even at light load.") in report.markdown(doc, charts=())

    def step(rate: float, p99_ms: float) -> dict[str, Any]:
        return {"target_rate": rate, "p99_us": p99_ms * 1000}

    stopped_high = {"p99_bound_ms": 5.0, "max_rate": None, "curve": [step(800.0, 9.0), step(400.0, 7.5)]}
    assert report.unmet_line(stopped_high, None, 1000.0) == (  # 40% of the peak is no light load
        "\np99 <= 5 ms: no rate met it. At the lowest rate tried, 400.0 q/s (40% of the sweep's peak), it was 7.50 ms.")
    assert report.unmet_line({**stopped_high, "max_rate": 400.0}, None, 1000.0) == ""  # met: nothing to say
    assert report.unmet_line({**stopped_high, "curve": []}, None, None) == ""


def test_cpu_per_query_divides_over_the_answered_queries_and_the_report_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused query costs the chain next to nothing: dividing the processes' CPU over it too would make
    a point that refused half its load read as half the CPU per query it served."""
    from recpipe.characterize import document, sections
    from recpipe.querygen import session

    readings = iter([{"gateway": 10.0, "querygen": 1.0}, {"gateway": 12.0, "querygen": 1.5}])
    compute = iter([{"gateway": None, "ranking": 3.0}, {"gateway": None, "ranking": 3.5}])

    monkeypatch.setattr(sections.Chain, "cpu", lambda self: dict(next(readings)))
    monkeypatch.setattr(sections.Chain, "counters", lambda self: sections.Counters({}, dict(next(compute))))
    # 1,000 measured queries, 600 of them refused, and 10 warm-ups: 410 answered (the warm-ups' CPU is in it)
    run = {"queries": 1000, "ok": 400, "errors": 600, "warmup_queries": 10,
           "generator": {"sender_cpu_s": 0.0, "processes": 1}}

    async def execute(config: Any) -> dict[str, Any]:
        return run

    monkeypatch.setattr(session, "execute", execute)
    m = sections._measure(sections.Chain("127.0.0.1:58001", {"gateway": [1]}, {}), None)
    assert m.cpu == {"gateway": round(2.0 / 410, 6), "querygen": round(0.5 / 410, 6)}
    assert m.compute["ranking"] == round(0.5 / 410, 6)
    assert document.COUNTS["cpu_per_query"] == document.ANSWERED  # what the blocks now say of themselves
    # the report says which: a document written now per answered query, one from before per query sent
    doc = json.loads((Path(__file__).parent.parent / "data" / "characterization_h200_03a97ac.json").read_text())
    before = json.loads(json.dumps(doc))
    assert "CPU seconds per query sent (ms of CPU) per process, sequential:" in report.markdown(doc, charts=())
    assert "CPU ms/q: each process group's ms of CPU per query sent, the warm-up's too." in report.markdown(doc)
    for name in ("sequential", "sweep"):
        doc["sections"][name]["counts"] = dict(document.COUNTS)
    text = report.markdown(doc, charts=())
    assert "CPU seconds per answered query (ms of CPU) per process, sequential:" in text
    assert "CPU ms/q: each process group's ms of CPU per answered query, the warm-up's too." in text
    # compared with a document from before, the CPU table says the two divide differently
    assert "CPU per query sent in a; answered query in b: alike only where no query failed." in compare.markdown(
        [("a", before), ("b", doc)])
    assert "alike only where" not in compare.markdown([("a", before), ("b", before)])
