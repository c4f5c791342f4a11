"""The data-paths section of ``recpipe characterize`` driven by a fake device timer on the CPU: its
arithmetic (GB/s, ns per row, medians, the torch cross-check, the placement advice, a stage's copy time),
its JSON block, the report's rows, ``recpipe report`` of two characterizations with the section and of an
old one without it (main at 03a97ac on an H200, tests/data), the stages' copy counters, and the skip
without a GPU."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from recpipe.accel.traffic import KEY, Traffic
from recpipe.accel.transfer import DeviceIO
from recpipe.characterize import compare, datapaths, report
from recpipe.characterize.datapaths import (
    D2H,
    DEVICE,
    H2D,
    HOST,
    KB,
    MB,
    RANDOM,
    SORTED,
    Copy,
    Gather,
    Plan,
    Tables,
)
from recpipe.cli import main

OLD = Path(__file__).parents[1] / "data" / "characterization_h200_03a97ac.json"
PLAN = Plan(copy_bytes=(64 * KB, MB, 256 * MB), repeats=5, warmup=2, lookups=1000, table_bytes=64 * MB,
            small_bytes=256, check_bytes=256 * MB)
TABLES = Tables(ranking_dim=16, ranking_rows=200_000, retrieval_dim=64, retrieval_rows=850_000)


@dataclass
class FakeTimer:
    """A platform in numbers: a copy takes ``latency_s`` + bytes / bandwidth (the host clock adds
    ``host_extra_s`` and runs a plain torch copy at ``torch_factor`` of the bandwidth), a gather its
    bytes at the GB/s of its placement and order. Each call's last run is an outlier (fifty times as
    long, like a page fault): the medians must not see it."""

    h2d_gbps: float = 50.0
    d2h_gbps: float = 40.0
    pageable_factor: float = 0.2
    latency_s: float = 2e-6
    host_extra_s: float = 8e-6
    torch_factor: float = 1.0
    gather_gbps: dict[tuple[str, str], float] = field(default_factory=lambda: {
        (DEVICE, RANDOM): 400.0, (DEVICE, SORTED): 800.0, (HOST, RANDOM): 100.0, (HOST, SORTED): 300.0})
    calls: list[tuple[Copy | Gather, int, int, str]] = field(default_factory=list)

    def describe(self) -> str:
        return "fake:0 (a platform in numbers)"

    def seconds(self, op: Copy | Gather, clock: str) -> float:
        if isinstance(op, Gather):
            return op.lookups * op.row_bytes / (self.gather_gbps[op.where, op.order] * 1e9)
        bw = (self.h2d_gbps if op.direction == H2D else self.d2h_gbps) * 1e9
        bw *= 1.0 if op.pinned else self.pageable_factor
        if clock == HOST:
            return self.latency_s + self.host_extra_s + op.nbytes / (bw * self.torch_factor)
        return self.latency_s + op.nbytes / bw

    def time(self, op: Copy | Gather, repeats: int, warmup: int, clock: str = DEVICE) -> list[float]:
        self.calls.append((op, repeats, warmup, clock))
        t = self.seconds(op, clock)
        return [t] * (repeats - 1) + [50 * t]


def _block(timer: FakeTimer | None = None) -> dict[str, Any]:
    return datapaths.measure(PLAN, TABLES, timer or FakeTimer())


def test_the_section_times_every_path_after_warm_up_and_takes_medians() -> None:
    timer = FakeTimer()
    block = _block(timer)
    assert block["measured"] is True and block["device"] == timer.describe()
    assert all((r, w) == (PLAN.repeats, PLAN.warmup) for _, r, w, _ in timer.calls)
    # every size each way, pinned and pageable, on the device clock
    copies = block["copies"]
    assert [(c["direction"], c["memory"], c["bytes"]) for c in copies] == [
        (d, m, n) for d in (H2D, D2H) for m in ("pinned", "pageable") for n in PLAN.copy_bytes]
    for c, op in zip(copies, (o for o, *_ in timer.calls), strict=False):
        assert c["median_s"] == pytest.approx(timer.seconds(op, DEVICE), rel=1e-5)  # the outlier run is ignored
        assert c["gbps"] == pytest.approx(c["bytes"] / c["median_s"] / 1e9, rel=1e-3)
    big = datapaths.find_copy(block, H2D, "pinned", 256 * MB)
    assert big is not None and big["gbps"] == pytest.approx(50.0, rel=1e-3)
    pageable = datapaths.find_copy(block, D2H, "pageable", 256 * MB)
    assert pageable is not None and pageable["gbps"] == pytest.approx(8.0, rel=1e-3)
    # one small copy each way, on both clocks
    assert block["small_copy"]["bytes"] == 256
    assert block["small_copy"][H2D]["device_us"] == pytest.approx(2.0 + 256 / 50e9 * 1e6, abs=1e-3)
    assert block["small_copy"][D2H]["host_us"] == pytest.approx(10.0 + 256 / 40e9 * 1e6, abs=1e-3)
    # gathers: both tables' row sizes in fp32 and fp16, random and sorted, from GPU and host memory
    rows = block["gathers"]
    assert len(rows) == 16
    assert {(g["table"], g["row_bytes"]) for g in rows} == {("ranking", 64), ("ranking", 32), ("retrieval", 256),
                                                            ("retrieval", 128)}
    g = datapaths.find_gather(block, "retrieval", "fp16", SORTED, HOST)
    assert g is not None and g["gbps"] == pytest.approx(300.0) and g["table_rows"] == 64 * MB // 128
    assert g["ns_per_row"] == pytest.approx(128 / 300.0, rel=1e-3)  # 128 B at 300 GB/s: 0.43 ns a row
    assert block["tables"]["ranking"] == {"dim": 16, "rows": 200_000, "dtype": "fp32", "bytes": 12_800_000}
    assert block["plan"]["copy_bytes"] == list(PLAN.copy_bytes)
    json.dumps(block)  # the block is plain JSON


def test_arithmetic() -> None:
    assert datapaths.gbps(64e9, 2.0) == 32.0 and datapaths.gbps(1, 0.0) is None
    assert datapaths.ns_per_row(1e-3, 1000) == pytest.approx(1000.0) and datapaths.ns_per_row(1.0, 0) is None
    assert datapaths.median([5.0, 1.0, 3.0, 100.0, 2.0]) == 3.0
    assert datapaths.ratio(1.0, 0.0) is None and datapaths.ratio(None, 1.0) is None
    assert [datapaths.fmt_bytes(n) for n in (256, 64 * KB, MB, 12_800_000, 256 * MB, 3 << 30)] == [
        "256 B", "64 KB", "1 MB", "12.2 MB", "256 MB", "3 GB"]
    with pytest.raises(Exception, match="cross-check size"):
        Plan(copy_bytes=(MB,), repeats=1, warmup=0, lookups=1, table_bytes=MB, small_bytes=1, check_bytes=2 * MB)
    assert 256 * MB in datapaths.QUICK.copy_bytes and datapaths.FULL.copy_bytes[0] == 64 * KB
    assert datapaths.FULL.copy_bytes[-1] == 256 * MB


def test_the_torch_cross_check_is_computable_from_the_document() -> None:
    chk = _block()["torch_check"]
    assert chk["bytes"] == 256 * MB and chk["tolerance"] == 0.2
    assert chk["ratio"] == pytest.approx(chk["events_gbps"] / chk["torch_gbps"], rel=1e-3)
    assert chk["within"] is True  # 8 µs more over 5.4 ms
    slow = _block(FakeTimer(torch_factor=0.7))["torch_check"]  # torch's copy at 70%: events 1.43x of it
    assert slow["within"] is False and slow["ratio"] == pytest.approx(1 / 0.7, rel=1e-2)


def test_placement_advice_from_the_gather_at_the_ranking_row_size() -> None:
    far = _block()["placement"]  # host 100 vs GPU 400 GB/s
    assert far["row_bytes"] == 64 and far["host_over_device"] == pytest.approx(0.25)
    assert far["host_over_device_sorted"] == pytest.approx(300 / 800)
    assert far["host_within_10pct"] is False and far["frees_gpu_bytes"] == 12_800_000
    assert "keep them in GPU memory" in far["advice"] and "12.2 MB" in far["advice"]
    near = FakeTimer()
    near.gather_gbps[HOST, RANDOM] = 370.0  # 92.5% of GPU memory's
    place = _block(near)["placement"]
    assert place["host_within_10pct"] is True
    assert "`--embeddings host` would free 12.2 MB of GPU memory" in place["advice"]


def test_traffic_counters_read_back_and_subtract() -> None:
    t = Traffic()
    t.add_h2d(1000)
    t.add_h2d(24, copies=2)
    t.add_d2h(8)
    t.add_call()
    assert Traffic.parse(t.describe()) == t == Traffic(calls=1, h2d_bytes=1024, h2d_copies=3, d2h_bytes=8, d2h_copies=1)
    assert t.minus(Traffic(h2d_bytes=24, h2d_copies=1)) == Traffic(1, 1000, 2, 8, 1)
    for bad in (None, "", "calls=1", "calls=x h2d_bytes=1", "nonsense", t.describe() + " more=1"):
        assert Traffic.parse(bad) is None


def test_device_io_on_the_cpu_counts_calls_and_no_bytes() -> None:
    io = DeviceIO(torch.device("cpu"))
    io.put("a", np.ones((3, 2), np.float32), np.float32, rows=4)  # a host copy to pad, nothing crosses
    io.fetch_many([("x", torch.ones(4)), ("y", torch.ones(4))], 3)
    assert io.traffic == Traffic(calls=1)


def test_bytes_per_query_and_the_time_they_take_on_the_measured_paths() -> None:
    before = {"ranking": Traffic(3, 100, 4, 10, 1), "retrieval": Traffic(), "gone": Traffic(9, 9, 9, 9, 9)}
    after = {"ranking": Traffic(13, 100 + 10 * 66_000, 44, 10 + 10 * 2_000, 11), "retrieval": Traffic(),
             "gone": Traffic(), "new": Traffic(1, 1, 1, 1, 1)}
    q = datapaths.per_query(before, after, 10)
    assert q["ranking"] == {"queries": 10, "calls": 1.0, "h2d_bytes": 66_000.0, "h2d_copies": 4.0,
                            "d2h_bytes": 2_000.0, "d2h_copies": 1.0}
    assert q["retrieval"] == {"queries": 10, "calls": 0.0, "h2d_bytes": 0.0, "h2d_copies": 0.0, "d2h_bytes": 0.0,
                              "d2h_copies": 0.0}
    assert q["gone"] is None and q["new"] is None  # restarted (counters went back); no earlier reading
    block = _block()
    # one copy: the small copy's latency below its size, linear between sizes, the top bandwidth beyond
    small = block["small_copy"][H2D]["device_us"] / 1e6
    row = datapaths.find_copy(block, H2D, "pinned", 64 * KB)
    assert row is not None
    at_64k = row["median_s"]
    assert datapaths.copy_seconds(block, H2D, 100) == pytest.approx(small)
    mid = datapaths.copy_seconds(block, H2D, (256 + 64 * KB) / 2)
    assert mid == pytest.approx((small + at_64k) / 2)
    assert datapaths.copy_seconds(block, H2D, 512 * MB) == pytest.approx(2 * datapaths.copy_seconds(block, H2D, 256 * MB))
    t = datapaths.stage_transfers(block, q)
    expected = 4 * datapaths.copy_seconds(block, H2D, 16_500) + datapaths.copy_seconds(block, D2H, 2_000)
    assert t["ranking"]["total_us"] == pytest.approx(expected * 1e6, abs=1e-3)
    assert t["retrieval"] == {"h2d_us": 0.0, "d2h_us": 0.0, "total_us": 0.0} and "gone" not in t
    assert datapaths.stage_transfers(datapaths.skipped("no GPU"), q) == {}


# ---- documents and reports ---------------------------------------------------------------------------


def _old() -> dict[str, Any]:
    return json.loads(OLD.read_text())


def _new(timer: FakeTimer | None = None) -> dict[str, Any]:
    """The old document as if measured now: the data paths and the copies per query added."""
    doc = _old()
    doc["sections"]["data_paths"] = _block(timer)
    doc["sections"]["sequential"]["transfers_per_query"] = {
        "retrieval": {"queries": 540, "calls": 1.0, "h2d_bytes": 1024.0, "h2d_copies": 2.0, "d2h_bytes": 8000.0,
                      "d2h_copies": 2.0},
        "ranking": {"queries": 540, "calls": 1.0, "h2d_bytes": 120_000.0, "h2d_copies": 4.0, "d2h_bytes": 2000.0,
                    "d2h_copies": 1.0}}
    return doc


def test_report_of_one_characterization_shows_the_section() -> None:
    doc = _new()
    md = report.markdown(doc)
    assert "## Data paths (CPU <-> GPU)" in md
    assert "| 256 MB | 49.98 | 10.00 | 39.99 | 8.00 |" in md
    assert "ratio 1.002, within 20%" in md
    assert "| ranking | fp32 | 64 | random | 400.00 | 100.00 | 25% | 0.16 | 0.64 |" in md
    assert "**Placement:** DLRM tables read in place from host memory gather at 25%" in md
    rows = report.transfer_rows(doc)
    assert list(rows) == ["retrieve", "rank"]
    rank = rows["rank"]
    seq = doc["sections"]["sequential"]["stages"]["rank"]
    assert rank["of_compute"] == pytest.approx(rank["transfer_us"] / seq["compute"]["mean_us"])
    assert f"| rank | 120000 | 4 | 2000 | 1 | {rank['transfer_us']:.1f} |" in md
    assert "data paths: pinned 256 MB H2D 49.98 GB/s" in report.summary(doc)
    skipped = _new()
    skipped["sections"]["data_paths"] = datapaths.skipped("no GPU on this machine")
    assert "_not measured: no GPU on this machine._" in report.markdown(skipped)
    assert "data paths: not measured: no GPU on this machine" in report.summary(skipped)


def test_report_of_an_old_characterization_says_not_measured() -> None:
    old = _old()
    assert "data_paths" not in old["sections"]
    md = report.markdown(old)
    assert "_not measured: no data paths section (a characterization from before it existed)._" in md
    assert "Copies per query" not in md


def test_report_a_b_shows_data_path_speed_ups_beside_the_stages() -> None:
    pcie, c2c = FakeTimer(), FakeTimer(h2d_gbps=400.0, d2h_gbps=400.0)
    c2c.gather_gbps[HOST, RANDOM] = 380.0
    a, b = _new(pcie), _new(c2c)
    b["sections"]["sequential"]["stages"]["rank"]["p50_us"] /= 2
    md = compare.markdown([("x86", a), ("gh", b)])
    assert "## Data paths (CPU <-> GPU; speed-up: more GB/s, less time)" in md
    assert "| H2D pinned 256 MB GB/s | 49.98 | 398.81 | 7.98x |" in md
    assert "| gather ranking fp32 random ids, host memory GB/s | 100.00 | 380.00 | 3.80x |" in md
    assert "| host memory / GPU memory gather | 25% | 95% |" in md
    line = [x for x in md.splitlines() if x.startswith("| rank |")][-1]
    stage_x, copies_x = line.strip("| ").split(" | ")[-2:]  # the stage's speed-up, beside its copies'
    assert stage_x == "2.00x" and float(copies_x.rstrip("x")) > 1
    assert "pinned H2D 256 MB 7.98x; host-memory table gather 3.80x" in compare.verdict("gh", a, b)


def test_report_a_b_with_an_old_characterization(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    new = tmp_path / "new.json"
    new.write_text(json.dumps(_new()))
    assert main(["report", str(OLD), str(new), "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "- characterization_h200_03a97ac: not measured: no data paths section" in text
    assert "| H2D pinned 256 MB GB/s | not measured | 49.98 | n/a |" in text
    assert "| host memory / GPU memory gather | not measured | 25% |" in text
    line = [x for x in text.splitlines() if x.startswith("| rank |")][-1]  # the stage beside its copies
    assert line.split(" | ")[2] == "not measured"
    capsys.readouterr()
    two = copy.deepcopy(_old())
    assert "## Data paths" in compare.markdown([("a", _old()), ("b", two)])  # neither: still a report


def test_the_section_is_skipped_with_its_reason_without_a_gpu(small_models: Path) -> None:
    from recpipe.characterize import cuda_timer, sections
    from recpipe.characterize.settings import QUICK, Settings

    def settings(device: str) -> Settings:
        return Settings(quick=True, sizes=QUICK, data="d", models=str(small_models), data_scale=None,
                        data_seed=None, dataset_sha256=None, device=device)

    assert sections.data_paths_section(settings("cpu")) == {"measured": False, "reason": "CPU run (--device cpu)"}
    if not torch.cuda.is_available():
        block = sections.data_paths_section(settings("auto"))
        assert block["measured"] is False and block["reason"].startswith("no GPU on this machine")
        assert cuda_timer.unavailable("auto") == block["reason"]
    tables = datapaths.tables_of(small_models)  # what the section reads of the model repository
    assert tables.ranking_dim >= 1 and tables.ranking_rows >= 1 and tables.retrieval_dim >= 1
    assert tables.ranking_bytes == tables.ranking_rows * tables.ranking_dim * 4


def test_the_cores_report_what_they_copied(small_models: Path) -> None:
    from recpipe.ranking.core import RankingCore
    from recpipe.retrieval.core import RetrievalCore

    ranking = RankingCore.load(small_models, device="cpu")
    retrieval = RetrievalCore.load(small_models, device="cpu")
    for core in (ranking, retrieval):
        t = Traffic.parse(core.details[KEY])
        assert t is not None and (t.h2d_bytes, t.d2h_bytes) == (0, 0)  # the CPU: nothing crosses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_timer_measures_the_quick_plan() -> None:
    """On a GPU: the real timer through the section (unverified until run on one)."""
    from recpipe.characterize.cuda_timer import CudaTimer

    plan = Plan(copy_bytes=(64 * KB, 16 * MB), repeats=3, warmup=1, lookups=4096, table_bytes=16 * MB,
                small_bytes=256, check_bytes=16 * MB)
    with CudaTimer(plan) as timer:
        block = datapaths.measure(plan, TABLES, timer)
    assert all(c["gbps"] and c["gbps"] > 0 for c in block["copies"])
    assert all(g["gbps"] and g["gbps"] > 0 for g in block["gathers"])
    assert block["placement"] is not None and block["torch_check"]["ratio"] is not None
    io = DeviceIO(torch.device("cuda:0"))
    with io.stream():
        io.fetch("y", io.to_device(io.put("x", np.ones((3, 2), np.float32), np.float32, rows=4)) * 2, 3)
    assert io.traffic == Traffic(calls=1, h2d_bytes=32, h2d_copies=1, d2h_bytes=24, d2h_copies=1)
