"""``recpipe characterize --quick`` end to end on the shared tiny dataset: the document's sections, the
report's files, resuming (a rerun skips finished sections), the budget, and ``recpipe report A B`` on
two characterizations (and its refusal where their settings differ)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from recpipe.characterize import document
from recpipe.characterize.report import CHARTS, MARKDOWN
from recpipe.cli import main
from recpipe.config import STEPS
from recpipe.errors import UsageError

PNG = b"\x89PNG\r\n\x1a\n"


def _characterize(out: Path, data: Path, models: Path, *extra: str) -> int:
    return main(["characterize", "--out", str(out), "--data", str(data), "--models", str(models), "--quick",
                 "--device", "cpu", *extra])


def _load(out: Path) -> dict:
    return json.loads((out / document.FILENAME).read_text())


@pytest.mark.slow
def test_characterize_quick_resumes_reports_and_compares(
        small_dataset: Path, small_models: Path, quick_characterization: Any, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    # the session's run of `characterize --threads 1 --quick --device cpu` (conftest), a copy of it resumed here
    shutil.copytree(quick_characterization.out, a)
    assert quick_characterization.stdout.startswith("characterization: ")
    doc = _load(a)
    assert doc["format"] == document.FORMAT and doc["format_version"] == document.FORMAT_VERSION
    assert list(doc["sections"]) == list(document.SECTIONS) and doc["not_run"] == {}
    s = doc["settings"]
    assert (s["quick"], s["device"], s["threads"], s["num_candidates"]) == (True, "cpu", "1", 500)
    sec = doc["sections"]
    assert sec["platform"]["cores"] >= 1 and sec["platform"]["memory_bytes"] > 0
    assert sec["platform"]["cpu_probe"]["sha256_mbps"]["best"] > 0  # how fast this CPU ran: report compares it
    seq = sec["sequential"]
    assert seq["queries"] == s["sizes"]["sequential_queries"] and seq["errors"] == 0
    for stage in STEPS:
        assert 0 < seq["stages"][stage]["p50_us"] <= seq["stages"][stage]["p99_us"]
    # CPU seconds per query of every stage process and of the generator, read from /proc
    assert set(seq["cpu_s_per_query"]) == {"features", "retrieval", "ranking", "gateway", "querygen"}
    assert all(v is not None and v > 0 for v in seq["cpu_s_per_query"].values())
    # of it, each stage's own core calls (their threads' CPU, from GetInfo before and after): some of its
    # process's CPU, never all; the gateway has no core
    for p in [seq, *sec["sweep"]["points"]]:
        own = p["compute_cpu_s_per_query"]
        assert set(own) == {"features", "retrieval", "ranking"}, own
        assert all(v is not None and 0 < v < p["cpu_s_per_query"][st] for st, v in own.items()), (own, p["cpu_s_per_query"])
    assert seq["gpu_busy"] == {"measured": False, "reason": "CPU run (--device cpu)"}
    # what retrieval and ranking copied between host and device per query (GetInfo before and after):
    # nothing crosses on the CPU; ranking fetched one result per query
    copies = seq["transfers_per_query"]
    assert set(copies) == {"retrieval", "ranking"} and copies["ranking"]["calls"] == 1.0
    assert all(c["h2d_bytes"] == c["d2h_bytes"] == 0 for c in copies.values())
    # the data paths between CPU and GPU: recorded as skipped, with the reason
    paths = sec["data_paths"]
    assert (paths["measured"], paths["reason"]) == (False, "CPU run (--device cpu)")
    points = sec["sweep"]["points"]
    assert [p["concurrency"] for p in points] == [2 ** i for i in range(len(points))]
    assert all(p["throughput"] > 0 and set(p["stages"]) == set(STEPS) for p in points)
    assert sec["sweep"]["stop_reason"]
    # a CPU run samples no GPU, point by point either
    assert all(p["gpu_busy"] is None for p in points) and sec["sweep"]["peak_gpu_busy"] is None
    # what each point kept busy: the machine's share of its cores, and the cores of each process group
    for p in [*points, seq]:
        busy = p["load"]
        assert 0 < busy["machine_busy"] <= 1 and set(busy["cores"]) == set(seq["cpu_s_per_query"])
        assert all(c is not None and 0 < c <= 1.05 * sec["platform"]["cores"] for c in busy["cores"].values()), busy
        assert {k: v for k, v in busy["processes"].items() if k != "querygen"} == {
            "features": 1, "retrieval": 1, "ranking": 1, "gateway": 1}
        assert busy["processes"]["querygen"] >= 1
    searches = sec["slo"]["searches"]
    assert [x["p99_bound_ms"] for x in searches] == s["sizes"]["slo_bounds_ms"]
    for x in searches:  # the two sides of each knee, with their steps' split by query
        met = x["knee"]["met"]
        assert (met is None) == (x["max_rate"] is None) and (met is None or met["rate"] == x["max_rate"])
        for step in (v for v in x["knee"].values() if v is not None):
            assert step["attribution"]["p99"]["end_to_end_us"] > 0
    assert all(1 <= len(x["curve"]) <= s["sizes"]["slo_max_steps"] for x in searches)
    benches = sec["micro"]["benches"]
    assert [x["name"].split()[0] for x in benches] == ["ranking", "retrieval", "features", "hop", "ranking"]
    batched = benches[-1]["rows"]  # B queries x 500 candidates per RankingCore.rank_batch call
    assert [r["form"] for r in batched] == [f"served, batch {b} x 500" for b in s["sizes"]["ranking_query_batches"]]
    assert all(0 < r["per_query_ms"] <= r["p50_ms"] for r in batched)
    for bench in benches:
        assert bench["rc"] == 0 and not bench["error"] and bench["rows"], bench["stdout"]
    assert {r["what"].split()[0] for r in benches[1]["recalls"]} == {"served", "fp16", "bf16"}
    report = a / "report"
    assert "## Closed-loop concurrency sweep" in (report / MARKDOWN).read_text()
    assert "What the peak kept busy: machine " in (report / MARKDOWN).read_text()
    assert "Sequential, the stages' own computing (their core calls' CPU" in (report / MARKDOWN).read_text()
    assert "clients), the stages' own computing" in (report / MARKDOWN).read_text()
    assert "- CPU probe: " in (report / MARKDOWN).read_text() and "MB/s SHA-256" in (report / MARKDOWN).read_text()
    assert "_not measured: CPU run (--device cpu)._" in (report / MARKDOWN).read_text()
    # where the slowest 1% went, sequential and at the sweep's peak: the same queries' parts
    peak = next(p for p in points if p["concurrency"] == sec["sweep"]["peak_concurrency"])
    for block in (seq, peak):
        tail = block["attribution"]["p99"]
        parts = tail["client_us"] + tail["gateway_us"] + sum(
            b["server_us"] + b["hop_us"] for b in tail["stages"].values())
        assert parts == pytest.approx(tail["end_to_end_us"], rel=1e-3)
    # the report says so where the slowest 1% are 5 queries or more (a quick run's sequential part is not)
    said = f"At the sweep's peak ({peak['concurrency']} clients), the slowest 1% of queries"
    assert (said in (report / MARKDOWN).read_text()) == (peak["attribution"]["p99"]["queries"] >= 5)
    assert ("Sequential, the slowest 1%" in (report / MARKDOWN).read_text()) == (
        seq["attribution"]["p99"]["queries"] >= 5)
    for chart in CHARTS:
        assert (report / chart).read_bytes().startswith(PNG)

    # a rerun into the same --out skips every finished section
    capsys.readouterr()
    assert _characterize(a, small_dataset, small_models, "--threads", "1") == 0
    err = capsys.readouterr().err
    for name in document.SECTIONS:
        assert f"{name}: finished in an earlier run, skipped" in err
    assert _load(a)["sections"] == sec
    # ... and refuses other settings
    assert _characterize(a, small_dataset, small_models, "--threads", "2") == 2
    assert "threads '1' vs '2'" in capsys.readouterr().err

    # the budget: nothing starts once it is spent, and the document says so
    spent = tmp_path / "spent"
    assert _characterize(spent, small_dataset, small_models, "--threads", "2", "--budget-s", "1e-9") == 0
    assert _load(spent)["sections"] == {} and set(_load(spent)["not_run"]) == set(document.SECTIONS)
    assert "not started, the budget" in capsys.readouterr().err
    # a rerun resumes where a budget stopped: a's document less its last section runs that section alone
    # (a whole run from nothing done is a's first run above: the same code)
    partial = _load(a)
    del partial["sections"]["data_paths"]
    partial["not_run"] = {"data_paths": "budget of 30 s spent"}
    b.mkdir()
    (b / document.FILENAME).write_text(json.dumps(partial))
    assert _characterize(b, small_dataset, small_models, "--threads", "1") == 0
    err = capsys.readouterr().err
    assert "sequential: finished in an earlier run, skipped" in err and "data_paths: done in" in err
    assert list(_load(b)["sections"]) == list(document.SECTIONS) and _load(b)["not_run"] == {}

    # report A B: section by section, with speed-ups
    capsys.readouterr()
    assert main(["report", str(a), str(b / document.FILENAME), "--out", str(tmp_path / "ab")]) == 0
    text = (tmp_path / "ab" / "report.md").read_text()
    for heading in ("## Sequential per-stage latency", "## CPU time per query", "## Closed-loop concurrency sweep",
                    "## SLO search", "## Micro-benchmarks", "## Data paths", "## Verdict"):
        assert heading in text
    assert "b speed-up p50" in text and "- b: sequential end to end" in text
    assert "- a's peak kept busy: machine " in text and "- b's peak kept busy: machine " in text
    assert "- a, the stages' own computing" in text and "- b, the stages' own computing" in text
    for chart in ("curves.png", "stages.png"):
        assert (tmp_path / "ab" / chart).read_bytes().startswith(PNG)

    # settings that must match differ: refused with the setting named, compared under --force
    assert _characterize(c, small_dataset, small_models, "--num-candidates", "50", "--budget-s", "1e-9") == 0
    capsys.readouterr()
    assert main(["report", str(a), str(c), "--out", str(tmp_path / "ac")]) == 2
    err = capsys.readouterr().err
    assert "num_candidates 500 vs 50" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ac").exists()
    assert main(["report", str(a), str(c), "--out", str(tmp_path / "ac"), "--force"]) == 0
    assert "warning: settings differ: a vs c: num_candidates 500 vs 50" in capsys.readouterr().err  # a's first
    assert "_sequential: not in c; not compared._" in (tmp_path / "ac" / "report.md").read_text()


def test_report_refuses_a_mix_of_runs_and_characterizations(tmp_path: Path) -> None:
    char = tmp_path / "char.json"
    char.write_text(json.dumps(document.new({})))
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"format": "recpipe.querygen.run"}))
    assert main(["report", str(char), str(run), "--out", str(tmp_path / "r")]) == 2


def test_cpu_seconds_of_a_process_grow_with_its_work() -> None:
    import os

    from recpipe import cputime

    # a name's processes count together (a stage's replicas); one unreadable makes the sum unknown
    pids = {"me": [os.getpid()], "gone": [2**22 + 7], "me twice": [os.getpid(), os.getpid()],
            "me and gone": [os.getpid(), 2**22 + 7]}
    before = cputime.snapshot(pids)
    deadline = before["me"] + 0.05  # burn at least 50 ms of CPU (the counter ticks at 100 Hz)
    while (cputime.cpu_seconds(os.getpid()) or 0.0) < deadline:
        sum(range(10_000))
    after = cputime.snapshot(pids)
    per = cputime.per_query(before, after, 5)
    assert before["gone"] is None and per["gone"] is None and per["me and gone"] is None
    assert per["me"] is not None and per["me"] >= 0.05 / 5
    assert before["me twice"] >= 2 * before["me"]  # read after "me", each at least as far on
    assert cputime.per_query({"x": 2.0}, {"x": 1.0}, 5) == {"x": None}  # restarted: counter went back


def test_bench_rows_are_parsed_from_the_printed_tables() -> None:
    import numpy as np

    from recpipe.bench._timing import Timing, table
    from recpipe.characterize.micro import parse_recalls, parse_rows

    text = "ranking bench: cpu\n" + table([Timing("naive (60 calls)", np.array([2_000_000, 4_000_000]), 10),
                                           Timing("served", np.array([1_000_000, 1_000_000]), 10)], "naive (60 calls)")
    text += "\nbare grpc.aio echo                       545       751\n  of which in the queue   14   25\n"
    rows = parse_rows(text)
    assert [r["form"] for r in rows] == ["naive (60 calls)", "served", "bare grpc.aio echo"]
    assert rows[1]["p50_ms"] == 1.0 and rows[2]["p99_ms"] == 0.751
    recalls = parse_recalls("served recall@100 vs exact on these queries: 0.9770\n"
                            "fp16 exact search alone: recall@500 vs fp32 exact 0.9983\nform p50\n")
    assert recalls == [{"what": "served recall@100 vs exact on these queries", "recall": 0.977},
                       {"what": "fp16 exact search alone: recall@500 vs fp32 exact", "recall": 0.9983}]


def test_settings_differences_name_each_field() -> None:
    from recpipe.characterize.settings import COMPARABLE, FULL, QUICK, RESUMABLE, Settings, differences

    a = Settings(quick=True, sizes=QUICK, data="d", models="m", data_scale=0.1, data_seed=11, dataset_sha256=None,
                 threads="1").to_json()
    b = Settings(quick=False, sizes=FULL, data="d", models="m", data_scale=0.1, data_seed=11, dataset_sha256=None,
                 threads="2").to_json()
    diff = differences(a, b, COMPARABLE)
    assert diff[0] == "quick True vs False" and "sizes.point_s 1.0 vs 5.0" in diff
    assert not any(d.startswith("threads") for d in diff)
    assert "threads '1' vs '2'" in differences(a, b, RESUMABLE)


def test_replicas_are_a_setting_that_documents_from_before_it_resume_with() -> None:
    from recpipe.characterize.settings import QUICK, RESUMABLE, Settings, differences

    now = Settings(quick=True, sizes=QUICK, data="d", models="m", data_scale=0.1, data_seed=11,
                   dataset_sha256=None).to_json()
    assert now["replicas"] == "auto"
    before = {k: v for k, v in now.items() if k != "replicas"}  # written before --replicas existed
    assert differences(before, {**now, "replicas": "1"}, RESUMABLE) == []
    assert differences(before, now, RESUMABLE) == ["replicas '1' vs 'auto'"]
    assert differences(before, {**now, "replicas": "ranking=2"}, RESUMABLE) == ["replicas '1' vs 'ranking=2'"]
    assert differences(now, {**now, "generator_processes": 1}, RESUMABLE) == []  # the generator may differ


def test_affinity_is_a_setting_that_documents_from_before_it_resume_with_as_off() -> None:
    from recpipe.characterize.settings import QUICK, RESUMABLE, Settings, differences

    now = Settings(quick=True, sizes=QUICK, data="d", models="m", data_scale=0.1, data_seed=11,
                   dataset_sha256=None).to_json()
    assert now["affinity"] == "auto"
    before = {k: v for k, v in now.items() if k != "affinity"}  # written before --affinity existed: unpinned
    assert differences(before, {**now, "affinity": "off"}, RESUMABLE) == []
    assert differences(before, now, RESUMABLE) == ["affinity 'off' vs 'auto'"]
    with pytest.raises(UsageError, match="--affinity must be auto or off"):
        Settings(quick=True, sizes=QUICK, data="d", models="m", data_scale=0.1, data_seed=11, dataset_sha256=None,
                 affinity="on")


def test_the_batched_ranking_bench_runs_on_the_characterizations_threads_and_gives_the_process_its_own_back(
        small_models: Path, small_dataset: Path) -> None:
    import torch

    from recpipe.characterize import ranking_batches
    from recpipe.characterize.settings import QUICK, Settings

    settings = Settings(quick=True, sizes=QUICK, data=str(small_dataset), models=str(small_models), data_scale=None,
                        data_seed=None, dataset_sha256=None, threads="1", num_candidates=50)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        block = ranking_batches.run(settings)
        assert block["error"] == "" and "torch threads 1," in block["stdout"], block
        assert len(block["rows"]) == len(QUICK.ranking_query_batches)
        assert torch.get_num_threads() == 3  # recpipe characterize also runs in its caller's process
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_the_chain_of_a_characterization_counts_a_stage_replicas_together(small_models: Path,
                                                                          small_dataset: Path) -> None:
    from recpipe.characterize.sections import chain
    from recpipe.characterize.settings import QUICK, Settings

    settings = Settings(quick=True, sizes=QUICK, data=str(small_dataset), models=str(small_models), data_scale=None,
                        data_seed=None, dataset_sha256=None, threads="1", replicas="ranking=2",
                        serve_args=("--ranking-precision", "fp32"))
    with chain(settings, "WARNING") as ch:
        assert len(ch.pids["ranking"]) == 2 and len(set(ch.pids["ranking"])) == 2
        assert len(ch.pids["features"]) == 1 and ch.addresses["ranking"][0] != ch.addresses["ranking"][1]
        cpu = ch.cpu()
        assert set(cpu) == {"features", "retrieval", "ranking", "gateway", "querygen"}
        assert all(v is not None and v > 0 for v in cpu.values()), cpu


def test_generator_processes_reach_the_loads_but_not_the_sequential_run() -> None:
    from recpipe.characterize.sections import _config
    from recpipe.characterize.settings import QUICK, Settings

    settings = Settings(quick=True, sizes=QUICK, data="d", models="m", data_scale=0.1, data_seed=11,
                        dataset_sha256=None, generator_processes=4)
    assert settings.to_json()["generator_processes"] == 4
    assert _config(settings, ":1", mode="sequential", queries=5).processes == 1
    assert _config(settings, ":1", mode="open", rate=10.0, duration=1.0).processes == 4
    # the sweep's first points have fewer clients than processes: one client per process at most
    assert [_config(settings, ":1", mode="closed", concurrency=c, duration=1.0).processes for c in (1, 2, 8)] == [
        1, 2, 4]
    auto = Settings(quick=True, sizes=QUICK, data="d", models="m", data_scale=0.1, data_seed=11,
                    dataset_sha256=None, generator_processes="auto")
    assert _config(auto, ":1", mode="closed", concurrency=1, duration=1.0).processes == "auto"


def test_gpu_busy_sampling_skips_cleanly_without_a_gpu() -> None:
    from recpipe.characterize.gpu import BusySampler

    with BusySampler(False, why_not="CPU run") as s:
        pass
    assert s.result() == {"measured": False, "reason": "CPU run"}
    import shutil

    if shutil.which("nvidia-smi") is None:
        with BusySampler(True, interval_s=0.01) as s:
            pass
        assert s.result()["measured"] is False and s.result()["reason"]


def test_gpu_busy_samples_average_and_the_sweep_reports_its_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's arithmetic with a reading that stands in for nvidia-smi, and how the report and
    BENCHMARKS.md's table show the sweep's average beside its peak point's."""
    import importlib.util
    import time

    from recpipe.characterize import gpu, report

    readings = iter([30.0, 50.0])
    monkeypatch.setattr(gpu, "_smi_reader", lambda: lambda: next(readings, 50.0))
    with gpu.BusySampler(True, interval_s=0.01) as s:
        time.sleep(0.1)
    got = s.result()
    assert got["measured"] and got["samples"] >= 2 and 0.3 < got["busy_fraction"] <= 0.5
    assert s.fraction_since(0) == got["busy_fraction"] and s.fraction_since(1) == 0.5  # a point's own part
    assert s.fraction_since(s.mark()) is None
    sweep = {"gpu_busy": {"measured": True, "samples": 20, "busy_fraction": 0.42}, "peak_gpu_busy": 0.61,
             "peak_concurrency": 64}
    assert report._gpu_line(sweep)[0] == "GPU busy fraction: 0.42 (20 samples); 0.61 at the peak (64 clients)"
    assert report._gpu_line({**sweep, "peak_gpu_busy": None})[0] == "GPU busy fraction: 0.42 (20 samples)"
    spec = importlib.util.spec_from_file_location("benchmark_tables", Path(__file__).parents[2] / "benchmarks" / "tables.py")
    assert spec and spec.loader
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    run = type("R", (), {"sections": {"sweep": sweep}})()
    assert tables._gpu_busy(run) == "0.42 (0.61 at the peak)"
    run.sections = {"sweep": {**sweep, "peak_gpu_busy": None}}
    assert tables._gpu_busy(run) == "0.42"


@pytest.mark.parametrize("flags, message", [
    (["--slo-p99-ms", "10,x"], "--slo-p99-ms takes numbers"),
    (["--slo-p99-ms", "0"], "--slo-p99-ms bounds must be numbers of ms > 0"),
    # infinity would reach the document as Infinity, which no JSON reader but Python's takes
    (["--slo-p99-ms", "20,inf"], "--slo-p99-ms bounds must be numbers of ms > 0, got '20,inf'"),
    (["--sweep-p99-ms", "inf"], "--sweep-p99-ms must be a finite number > 0, got inf"),
    (["--budget-s", "inf"], "--budget-s must be a finite number > 0, got inf"),
    (["--data", "nowhere"], "--data nowhere: no such directory"),  # as serve and the benches say it
    (["--data", "E"], "E: no manifest.json there"),
    (["--scale", "2"], "--scale must be in (0, 1]"),
    (["--budget-s", "0", "--data", "D", "--models", "M"], "--budget-s must be a finite number > 0, got 0.0"),
    (["--generator-processes", "0"], "--generator-processes must be in 1..64"),
    (["--generator-processes", "many"], "--generator-processes must be a whole number or auto"),
])
def test_bad_flags_exit_2_with_one_line_and_write_nothing(
        flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("D", "M"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    (tmp_path / "E").mkdir()  # a directory, but no dataset's
    flags = [str(tmp_path / f) if f in ("D", "M", "E") else f for f in flags]
    out = tmp_path / "out"
    assert main(["characterize", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()
