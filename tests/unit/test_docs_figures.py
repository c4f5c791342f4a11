"""The figures and defaults that docs/ states in prose are the code's and the reference documents'.

Each test reads a sentence of a page under docs/ and checks its numbers against the constant or the
committed characterization (benchmarks/) it describes, so that a changed default or a replaced
document fails here rather than leaving the page stale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from recpipe import config
from recpipe.gateway import readiness
from recpipe.querygen.config import DEFAULT_NUM_USERS
from recpipe.serving.config import METRICS_PORT_OFFSET
from recpipe.serving.launch import MAX_REPLICAS
from recpipe.stages import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BENCH = ROOT / "benchmarks"


def _text(name: str) -> str:
    """A page's text with its line breaks and indentation folded into single spaces."""
    return " ".join((DOCS / name).read_text(encoding="utf-8").split())


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def _characterization(name: str) -> dict:
    return json.loads((BENCH / name / "characterization.json").read_text(encoding="utf-8"))


def _slo_rate(doc: dict, bound_ms: float) -> float:
    return next(s["max_rate"] for s in doc["sections"]["slo"]["searches"] if s["p99_bound_ms"] == bound_ms)


def test_serving_quotes_the_h200_replica_runs_as_their_documents_say() -> None:
    m = re.search(r"these counts reached ([\d,]+) q/s at p99 <= 20 ms and a peak of ([\d,]+) q/s, against "
                  r"([\d,]+) and ([\d,]+) for 2 per stage", _text("serving.md"))
    assert m, "serving.md no longer quotes the H200 replica runs"
    auto, two = _characterization("h200-cuda-g4f3-78cf8d1"), _characterization("h200-cuda-78cf8d1")
    assert auto["settings"]["replicas"] == "gateway=4,features=3,retrieval=2,ranking=2"
    assert [_num(g) for g in m.groups()] == [
        round(_slo_rate(auto, 20.0)), round(auto["sections"]["sweep"]["peak_throughput"]),
        round(_slo_rate(two, 20.0)), round(two["sections"]["sweep"]["peak_throughput"])]


def test_serving_states_the_replicas_auto_counts() -> None:
    text = _text("serving.md")
    for gpu, phrase in ((False, r"On 16 cores: gateway (\d), features (\d), retrieval (\d), ranking (\d) \(CPU costs"),
                        (True, r"On 16 cores: gateway (\d), features (\d), retrieval (\d), ranking (\d)\. On the H200")):
        m = re.search(phrase, text)
        assert m, phrase
        counts = REGISTRY.auto_replicas(16, MAX_REPLICAS, gpu=gpu)
        assert [int(g) for g in m.groups()] == [counts[s] for s in ("gateway", "features", "retrieval", "ranking")]
    assert "Below 10 cores every stage keeps one" in text
    assert set(REGISTRY.auto_replicas(9, MAX_REPLICAS).values()) == {1}
    assert set(REGISTRY.auto_replicas(10, MAX_REPLICAS).values()) != {1}
    # measuring.md's summary of characterize's default: one each below 10 cores, below 7 with a GPU
    assert "one process per stage on fewer than 10 cores, 7 with a GPU" in _text("measuring.md")
    assert set(REGISTRY.auto_replicas(6, MAX_REPLICAS, gpu=True).values()) == {1}
    assert set(REGISTRY.auto_replicas(7, MAX_REPLICAS, gpu=True).values()) != {1}


def test_serving_states_the_gateways_health_checks() -> None:
    text = _text("serving.md")
    m = re.search(r"checks them every ([\d.]+) s \(([\d.]+) s while the chain is not ready\) over the channels it "
                  r"calls them on, with a ([\d.]+) s deadline", text)
    assert m
    assert [float(g) for g in m.groups()] == [readiness.INTERVAL_S, readiness.NOT_READY_INTERVAL_S,
                                              readiness.TIMEOUT_S]
    assert readiness.SILENT_CHECKS == 2 and "has not answered two health checks in a row (frozen)" in text


def test_serving_states_the_ports_and_message_limits() -> None:
    text = _text("serving.md")
    assert f"gateway {config.DEFAULT_PORT}, features {config.DEFAULT_PORT + 1}" in text
    assert f"Prometheus on the gRPC port + {METRICS_PORT_OFFSET}" in text
    m = re.search(r"A batch message holds at most ([\d,]+) entries and ([\d,]+) rows", text)
    assert m and [_num(g) for g in m.groups()] == [config.MAX_BATCH_ENTRIES, config.MAX_BATCH_ROWS]
    assert f"`--hop-max-batch` is at most {config.MAX_BATCH_ENTRIES}" in text


def test_measuring_states_where_querygen_takes_its_user_count() -> None:
    m = re.search(r"User ids are 0\.\.N-1: N is `--num-users`, else the `num_users` that the stages report through "
                  r"GetInfo, else ([\d,]+)\.", _text("measuring.md"))
    assert m and _num(m.group(1)) == DEFAULT_NUM_USERS


def test_the_pages_state_the_max_batch_default() -> None:
    from recpipe.ranking.core import SEGMENT_USERS
    from recpipe.serving.batcher import BatchConfig

    gpu, cpu = (BatchConfig().for_device(d).max_batch for d in ("cuda:0", "cpu"))
    assert f"the default 0 means {gpu} where the stage computes on a GPU and {cpu} on a CPU" in _text("serving.md")
    bench = " ".join((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").split())
    m = re.search(r"`--max-batch` defaults to (\d+) on a GPU and to (\d+) on a CPU \(a batched hop's entries still "
                  r"reach ranking as one call, which the segmented bf16 form runs (\d+) users to a forward", bench)
    assert m and [int(g) for g in m.groups()] == [gpu, cpu, SEGMENT_USERS]
