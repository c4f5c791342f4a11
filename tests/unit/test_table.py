"""The one per-stage table (querygen, demo) and serve's summary: units in every header cell, the machine
line, the legend, unsupported percentiles cut with a warning, the queue/compute rows."""

from __future__ import annotations

import json
from pathlib import Path

from recpipe.querygen.table import machine_line, min_samples, run_table, serve_table

DATA = Path(__file__).resolve().parents[1] / "data"


def _header_cells(line: str) -> list[str]:
    return [c.strip() for c in line.split("  ") if c.strip()]


def test_min_samples_per_percentile() -> None:
    assert [min_samples(p) for p in (50, 90, 99, 99.9, 99.99)] == [2, 10, 100, 1000, 10000]


def test_run_table_of_300_sequential_queries() -> None:
    doc = json.loads((DATA / "run_sequential_300.json").read_text())
    lines = run_table(doc).splitlines()
    assert lines[0] == "recpipe querygen: mode sequential, achieved 90.0 q/s, 300 queries, 0 errors, 2026-11-20T09:00:00Z"
    assert lines[1] == ("machine: AMD EPYC 7B13, 2 cores, GPU none | features cpu 1 thread, retrieval cpu 1 thread, "
                        "ranking cpu 1 thread, gateway cpu 1 thread")
    header = _header_cells(lines[2])
    assert header[:2] == ["stage", "time"]
    assert all(cell.endswith(("(ms)", "(mean)")) for cell in header[2:]), header
    rows = [line.split() for line in lines[4:]]
    assert [r[0] for r in rows[:9:2]] == ["augment_user", "retrieve", "augment_items", "rank", "end"]
    assert rows[0][1] == "observed" and rows[1][0] == "server" and rows[8][:3] == ["end", "to", "end"]
    # 300 samples: p99 supported (100 needed), p99.9 not (1,000)
    assert rows[0][5] == "-" and rows[0][4] != "-"
    text = "\n".join(lines)
    assert "warning: p99.9 needs at least 1,000 samples, this run has 300" in text
    assert "queue/compute split: not reported by these stages" in text
    assert "legend: server = time inside the stage's own server; observed =" in text


def test_run_table_shows_queue_and_compute_where_reported() -> None:
    doc = json.loads((DATA / "run_open_slo_5000.json").read_text())
    text = run_table(doc)
    rank = text.split("\nrank ")[1].splitlines()[:4]
    assert [line.split()[0] for line in rank] == ["observed", "server", "queue", "compute"]
    assert rank[3].split()[-1] == "4.00"  # mean batch size on the compute row
    assert "p99.9 needs" not in text and "sent more than 1 ms late" in text
    assert "SLO p99 <= 50 ms: max rate 100.0 q/s (8 steps)" in text


def test_machine_line_without_stage_info() -> None:
    assert machine_line({"cpu": "X", "cores": 4, "gpu": "H100"}, {}) == (
        "machine: X, 4 cores, GPU H100 | stages: device and threads not reported")


def test_serve_table() -> None:
    text = serve_table([{"name": "features", "address": "127.0.0.1:50052", "pid": 7, "device": "cpu", "threads": 2,
                         "metrics": "http://127.0.0.1:51052/metrics"},
                        {"name": "gateway", "address": "127.0.0.1:50051", "pid": 8, "device": "cpu", "threads": 0}],
                       {"cpu": "X", "cores": 4, "gpu": "none"})
    lines = text.splitlines()
    assert lines[0] == "machine: X, 4 cores, GPU none | features cpu 2 threads, gateway cpu default threads"
    assert _header_cells(lines[1]) == ["stage", "address (host:port)", "pid", "device", "threads (n)",
                                       "metrics (url)"]
    assert lines[3].split() == ["features", "127.0.0.1:50052", "7", "cpu", "2", "http://127.0.0.1:51052/metrics"]
    assert lines[4].split() == ["gateway", "127.0.0.1:50051", "8", "cpu", "default", "off"]
