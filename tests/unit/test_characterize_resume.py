"""A section the budget cut short (the sweep stopped for it, an SLO bound or a micro-benchmark left out) is
not finished: a rerun into the same --out measures it again, and until then the document and the report
say what it lacks."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from recpipe.characterize import document, report, runner, sections
from recpipe.characterize.settings import QUICK, Settings

OLD = Path(__file__).parent.parent / "data" / "characterization_h200_03a97ac.json"


def _doc() -> dict[str, Any]:
    doc = json.loads(OLD.read_text())
    doc["sections"]["micro"]["skipped_for_budget"] = ["hop candidates 500", "ranking batched"]
    doc["sections"]["data_paths"] = {"measured": False, "reason": "CPU run (--device cpu)"}
    return doc


def test_a_micro_section_the_budget_cut_short_runs_again_and_says_so_until_then(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _doc()
    # the document as a budget left it: the report names what the micro-benchmarks lack
    assert "hop candidates 500, ranking batched not run" in report.markdown(doc).split("## Platform")[0]
    assert "not run or cut short (budget): micro" in report.summary(doc)

    ran: list[str] = []

    def micro(settings: Settings, time_left: Any) -> dict[str, Any]:
        ran.append("micro")
        return {"benches": [], "skipped_for_budget": []}

    monkeypatch.setattr(sections, "micro_section", micro)
    settings = Settings(quick=True, sizes=QUICK, data="D", models="M", data_scale=None, data_seed=None,
                        dataset_sha256=None, device="cpu")
    after = runner.run(settings, tmp_path, copy.deepcopy(doc), "WARNING")
    assert ran == ["micro"] and after["not_run"] == {} and report.not_run(after) == {}
    err = capsys.readouterr().err
    assert "micro: cut short by the budget: hop candidates 500, ranking batched not run in an earlier run" in err
    assert "sweep: finished in an earlier run, skipped" in err


@pytest.mark.parametrize("name, change, said", [
    ("sweep", {"stop_reason": "budget spent"}, "cut short by the budget after 5 points"),
    ("slo", {"skipped_for_budget_ms": [50.0]}, "cut short by the budget: bounds 50 ms not run"),
    ("micro", {"skipped_for_budget": []}, None),
])
def test_cut_short_names_what_the_budget_left_out(name: str, change: dict[str, Any], said: str | None) -> None:
    block = {**_doc()["sections"][name], **change}
    assert document.cut_short(name, block) == said
