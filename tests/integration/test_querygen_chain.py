"""querygen against the real serving chain (shared session fixtures: tiny dataset, trained models)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from recpipe.cli import main
from recpipe.config import STEPS

if TYPE_CHECKING:
    from recpipe.inprocess import ChainServers


def _run(tmp_path: Path, name: str, *argv: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    assert main(["querygen", *argv, "--out", str(out), "--quiet"]) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def test_sequential_and_per_component_against_the_chain(serving_chain: ChainServers,
                                                        dataset_info: dict[str, int], tmp_path: Path) -> None:
    t = serving_chain.targets
    gw = _run(tmp_path, "gw", "--target", t["gateway"], "--queries", "40", "--num-candidates", "50",
              "--users", "zipf")
    assert gw["queries"] == 40 and gw["errors"] == 0
    # The user-id range comes from the features stage, found through the gateway's GetInfo.
    assert gw["workload"]["num_users"] == dataset_info["num_users"]
    assert {"gateway", "features", "retrieval", "ranking"} <= set(gw["pipeline"])
    assert gw["model_version"]
    for stage in STEPS:
        s = gw["stages"][stage]
        assert s["count"] == 40 and 0 < s["server"]["p50_us"] <= s["p50_us"] * 1.01 + 5
    # Stages run one after another inside the gateway: the client waits at least their sum.
    assert gw["end_to_end"]["p50_us"] >= 0.9 * sum(gw["stages"][s]["p50_us"] for s in STEPS)
    # The slowest queries' time by stage: its parts add up to their end-to-end time, every stage took some.
    for band in gw["attribution"].values():
        parts = band["client_us"] + band["gateway_us"] + sum(
            st["server_us"] + st["hop_us"] for st in band["stages"].values())
        assert parts == pytest.approx(band["end_to_end_us"], rel=1e-3)
        assert all(st["server_us"] > 0 and st["hop_us"] > 0 for st in band["stages"].values())
        assert band["gateway_us"] >= 0 and band["client_us"] > 0
    assert gw["attribution"]["p99"]["end_to_end_us"] >= gw["attribution"]["median"]["end_to_end_us"]

    pc = _run(tmp_path, "pc", "--per-component", "--features", t["features"], "--retrieval", t["retrieval"],
              "--ranking", t["ranking"], "--queries", "40", "--num-candidates", "50",
              "--num-users", str(dataset_info["num_users"]))
    assert pc["per_component"] and pc["queries"] == 40 and pc["errors"] == 0
    for stage in STEPS:
        s = pc["stages"][stage]
        assert s["count"] == 40 and 0 < s["server"]["p50_us"] <= s["p50_us"] * 1.01 + 5
    assert pc["end_to_end"]["p50_us"] >= sum(pc["stages"][s]["p50_us"] for s in STEPS) * 0.9
    # each stage's own queue/compute split and batch size, as the gateway run has them
    for stage in STEPS:
        assert pc["stages"][stage]["batch_size"]["count"] == gw["stages"][stage]["batch_size"]["count"] == 40
