"""The CPU probe a characterization's platform section records, and the warning ``recpipe report`` gives
when two documents name the same CPU but ran it at different speeds (recpipe.characterize.cpu_probe)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

from recpipe import cputime
from recpipe.characterize import compare, cpu_probe, document

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_probe_times_hashing_a_matmul_and_a_copy_on_this_cpu() -> None:
    block = cpu_probe.probe(rounds=3)
    assert block["rounds"] == 3 and block["elapsed_s"] > 0
    for key, _ in cpu_probe.MEASURES:
        assert 0 < block[key]["median"] <= block[key]["best"], key
    assert block["steal"] is None or 0 <= block["steal"] <= 1
    line = cpu_probe.describe(block)
    assert "MB/s SHA-256" in line and "GFLOP/s matmul" in line and "GB/s copy" in line and "best of 3" in line
    assert cpu_probe.speed_ratio(block, block) == pytest.approx(1.0)


def test_the_probe_leaves_the_thread_counts_as_it_found_them() -> None:
    import faiss  # loaded: the matmul's one thread is FAISS's too where they share an OpenMP runtime
    import torch

    before = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(3)
    try:
        mine = torch.get_num_threads(), faiss.omp_get_max_threads()
        assert cpu_probe.probe(rounds=1)["matmul_gflops"]
        assert (torch.get_num_threads(), faiss.omp_get_max_threads()) == mine
    finally:
        torch.set_num_threads(before[0])
        faiss.omp_set_num_threads(before[1])


def test_busy_and_steal_are_read_from_proc_stat_where_the_kernel_gives_them(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n")
    before = cputime.machine_ticks(stat)
    assert before == cputime.MachineTicks(busy=155, steal=35, total=1000)
    # 100 more jiffies on all CPUs: 60 busy (user 40, system 15, softirq 5), 30 idle, 10 steal
    stat.write_text("cpu  140 0 65 830 10 0 10 45 0 0\n")
    after = cputime.machine_ticks(stat)
    assert after is not None and before is not None
    assert before.busy_share(after) == 0.6
    assert before.busy_seconds(after) == 60 / os.sysconf("SC_CLK_TCK")
    assert after.busy_share(after) is None  # no time passed
    stat.write_text("cpu  100 0 50 800\n")  # an old kernel: no steal column
    assert cputime.machine_ticks(stat) is None
    assert cputime.machine_ticks(tmp_path / "missing") is None


def _probe(sha: float, matmul: float | None) -> dict[str, Any]:
    return {"sha256_mbps": {"best": sha, "median": sha * 0.98},
            "matmul_gflops": None if matmul is None else {"best": matmul, "median": matmul * 0.97},
            "copy_gbps": {"best": 6.0, "median": 5.5}, "steal": 0.012, "rounds": 5, "elapsed_s": 0.3}


def test_describe_says_what_was_measured_and_a_document_before_the_probe_shows_a_dash() -> None:
    assert cpu_probe.describe(None) == cpu_probe.describe({}) == "-"
    assert cpu_probe.describe(_probe(1500.0, 80.0)) == (
        "1,500 MB/s SHA-256, 80.0 GFLOP/s matmul, 6.0 GB/s copy (one thread, best of 5; medians 1,470 / 77.6 / 5.5), "
        "steal 1.2%")
    assert "matmul" not in cpu_probe.describe(_probe(1500.0, None))  # no torch: no matmul
    assert cpu_probe.speed_ratio(_probe(1000.0, 100.0), _probe(640.0, 64.0)) == pytest.approx(0.64)
    assert cpu_probe.speed_ratio(_probe(1000.0, 100.0), _probe(640.0, None)) == pytest.approx(0.64)
    assert cpu_probe.speed_ratio(None, _probe(640.0, 64.0)) is None


def _with_probe(doc: dict[str, Any], probe: dict[str, Any] | None, cpu: str | None = None) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    if probe is not None:
        out["sections"]["platform"]["cpu_probe"] = probe
    if cpu is not None:
        out["sections"]["platform"]["cpu"] = cpu
    return out


def test_report_warns_when_the_same_cpu_ran_at_another_speed() -> None:
    base = document.load(BENCH / "h200-cuda-03a97ac")  # measured before the probe
    old = compare.markdown([("A", base), ("B", base)])
    assert "| CPU probe | - | - |" in old and "Warning" not in old
    fast, slow, close = _probe(1500.0, 80.0), _probe(1050.0, 56.0), _probe(1450.0, 76.0)
    text = compare.markdown([("A", _with_probe(base, fast)), ("B", _with_probe(base, slow))])
    assert "**Warning: B and A name the same CPU (Intel(R) Xeon(R) Processor), but B's ran the CPU probe 0.70x as fast**" in text
    assert "| CPU probe | 1,500 MB/s SHA-256" in text
    assert "Warning" not in compare.markdown([("A", _with_probe(base, fast)), ("B", _with_probe(base, close))])
    # another CPU is another machine: the comparison is the point, not a warning
    other = _with_probe(base, slow, cpu="AMD EPYC")
    assert "Warning" not in compare.markdown([("A", _with_probe(base, fast)), ("B", other)])
