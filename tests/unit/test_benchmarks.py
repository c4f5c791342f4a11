"""BENCHMARKS.md quotes the reference characterizations under benchmarks/ exactly, and they compare.

Each table BENCHMARKS.md marks with ``<!-- table: KIND NAME ... -->`` must be what
``benchmarks/tables.py`` renders from those documents today (a hand edit, or a document replaced
without ``python benchmarks/tables.py``, fails here). ``recpipe report A B`` must work on the committed
documents, and the user-facing pages stay short, in the project's words, with links that resolve.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from recpipe.cli import main

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
PAGE = ROOT / "BENCHMARKS.md"
PAGES = (ROOT / "README.md", PAGE, *sorted((ROOT / "docs").glob("*.md")), *sorted(BENCH.glob("*.md")))


def _tables() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_tables", BENCH / "tables.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _tables()


def test_every_marked_table_is_what_the_documents_say() -> None:
    found = tables.blocks(PAGE.read_text(encoding="utf-8"))
    assert len(found) >= 6
    stale = [f"{kind} {' '.join(names)}" for kind, names, body in found if tables.render(kind, names) != body]
    assert not stale, f"BENCHMARKS.md tables differ from benchmarks/*/ (run `python benchmarks/tables.py`): {stale}"


def test_a_changed_figure_is_caught() -> None:
    # the check compares figures at the precision printed: one digit off in a quoted cell fails
    kind, names, body = next(b for b in tables.blocks(PAGE.read_text(encoding="utf-8")) if b[0] == "summary")
    m = re.search(r"\| (\d+)\.(\d+) / ", body)
    assert m, body
    edited = body.replace(m[0], f"| {m[1]}.{int(m[2]) + 1:0{len(m[2])}d} / ", 1)
    assert edited != body and tables.render(kind, names) != edited


def test_every_reference_document_is_quoted_with_its_provenance() -> None:
    text = PAGE.read_text(encoding="utf-8")
    in_machine = {n for kind, names, _ in tables.blocks(text) if kind == "machine" for n in names}
    assert tables.names() and set(tables.names()) == in_machine
    for name in tables.names():
        about = json.loads((BENCH / name / "about.json").read_text(encoding="utf-8"))
        assert {"machine", "short", "commit", "commands"} <= set(about), name
        assert re.fullmatch(r"[0-9a-f]{7,40}", about["commit"]) and name.endswith(about["commit"]), name
        assert any(c.split()[0:2] == ["recpipe", "characterize"] or "recpipe characterize" in c
                   for c in about["commands"]), name
        doc = json.loads((BENCH / name / "characterization.json").read_text(encoding="utf-8"))
        assert doc["format"] == "recpipe.characterization" and not doc["settings"]["quick"], name
        assert set(doc["sections"]) >= {"platform", "sequential", "sweep", "slo", "micro"}, name


def test_every_reference_has_its_report_and_its_charts_stay_small() -> None:
    from recpipe.characterize import document
    from recpipe.characterize import report as writer

    for name in tables.names():
        report = BENCH / name / "report"
        # as the writer writes it today (10 of 15 had fallen behind it): `python benchmarks/tables.py --reports`
        assert (report / "report.md").read_text(encoding="utf-8") == writer.markdown(document.load(BENCH / name)), name
        for png in ("curve.png", "stages.png", "split.png"):
            size = (report / png).stat().st_size
            assert 0 < size < 200_000, (name, png, size)


@pytest.mark.parametrize("pair", [("h200-cuda-03a97ac", "h200-cpu-03a97ac"),
                                  ("h200-cuda-03a97ac", "h200-cuda-83e711b"),
                                  ("h200-cuda-d26ae00", "h200-cuda-wait0-d26ae00"),
                                  ("h200-cuda-03a97ac", "h200-cuda-252dad2"),
                                  ("h200-cpu-03a97ac", "epyc-2c-cpu-03a97ac")])
def test_report_compares_the_committed_documents(pair: tuple[str, str], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # `recpipe report benchmarks/A benchmarks/B --out DIR`, as BENCHMARKS.md says, without --force
    out = tmp_path / "report"
    assert main(["report", *(str(BENCH / n) for n in pair), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"| {pair[0]} p50 | {pair[0]} p99 | {pair[1]} p50 |" in text and "## Verdict" in text
    assert "Warning" not in text and (out / "report.md").read_text(encoding="utf-8") == text
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "report.md", "stages.png"]


def test_report_refuses_documents_measured_on_other_data(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    a, b = BENCH / "epyc-2c-cpu-03a97ac", BENCH / "epyc-2c-cpu-scale0.1-03a97ac"
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "r")]) == 2
    assert "data_scale 1.0 vs 0.1" in capsys.readouterr().err


def test_a_sweep_bound_makes_runs_unlike_only_where_it_stopped_a_sweep() -> None:
    # the sweep's p99 bound says only where a sweep stops; the table compares clients by clients
    from recpipe.characterize import compare, document

    base, run = (document.load(BENCH / n) for n in ("h200-cuda-03a97ac", "h200-cuda-252dad2"))
    assert base["settings"]["sizes"]["sweep_p99_ms"] != run["settings"]["sizes"]["sweep_p99_ms"]
    assert base["sections"]["sweep"]["stop_reason"].startswith("throughput rose less than")
    assert run["sections"]["sweep"]["stop_reason"] == "reached 64 clients"
    assert compare.differences(base, run) == []
    other = json.loads(json.dumps(run))
    other["settings"]["sizes"]["point_s"] = 1.0
    assert compare.differences(base, other) == ["sizes.point_s 5.0 vs 1.0"]
    # a sweep its bound stopped would have gone on under the other run's bound: unlike
    stopped = json.loads(json.dumps(run))
    stopped["sections"]["sweep"]["points"][-1]["p99_us"] = 150_000
    assert compare.differences(base, stopped) == ["sizes.sweep_p99_ms 200.0 vs 100.0"]


def test_a_sweep_cap_makes_runs_unlike_only_where_it_stopped_a_sweep() -> None:
    # the sweep's largest number of clients, like its bound, says only where a sweep stops
    from recpipe.characterize import compare, document
    from recpipe.characterize.settings import FULL

    base, capped = (document.load(BENCH / n) for n in ("h200-cuda-03a97ac", "h200-cuda-78cf8d1"))
    assert base["sections"]["sweep"]["stop_reason"].startswith("throughput rose less than")
    assert capped["sections"]["sweep"]["stop_reason"] == "reached 64 clients"
    wider = json.loads(json.dumps(base))
    wider["settings"]["sizes"]["max_concurrency"] = FULL.max_concurrency
    assert FULL.max_concurrency > 64
    # 03a97ac's sweep found its knee at 16 clients: a larger cap would not have moved it
    assert compare.differences(base, wider) == []
    # 78cf8d1's stopped at its cap of 64 while throughput still rose: against a larger cap, unlike
    assert compare.differences(capped, wider) == [f"sizes.max_concurrency 64 vs {FULL.max_concurrency}"]


def test_slo_bounds_differ_without_making_runs_unlike(tmp_path: Path) -> None:
    # a bound searched by one run only is "not searched" in the other, not "none met"
    from recpipe.characterize import compare, document

    cuda, cpu = (document.load(BENCH / n) for n in ("h200-cuda-03a97ac", "h200-cpu-03a97ac"))
    assert cuda["settings"]["sizes"]["slo_bounds_ms"] != cpu["settings"]["sizes"]["slo_bounds_ms"]
    assert compare.differences(cuda, cpu) == []
    other = json.loads(json.dumps(cpu))
    other["settings"]["data_seed"] = 1
    assert compare.differences(cuda, other) == ["data_seed 0 vs 1"]
    text = compare.markdown([("cuda", cuda), ("cpu", cpu)])
    assert "| 10 | none met | not searched | n/a |" in text


def test_tables_rewrite_only_what_is_marked(tmp_path: Path) -> None:
    for name in ("h200-cuda-03a97ac", "h200-cpu-03a97ac"):
        shutil.copytree(BENCH / name, tmp_path / name)
    page = ("# x\n\nprose 1.23 stays\n\n<!-- table: summary h200-cuda-03a97ac h200-cpu-03a97ac -->\nstale\n"
            "<!-- end table -->\n")
    new = tables.rewrite(page, tmp_path)
    assert new.startswith("# x\n\nprose 1.23 stays\n") and "stale" not in new
    assert "| sequential, end to end p50 / p99 (ms) | 7.95 / 9.29 | 10.3 / 12.7 |" in new
    assert tables.rewrite(new, tmp_path) == new


# --- the user-facing pages ---

def test_the_pages_stay_short() -> None:
    assert len(PAGE.read_text(encoding="utf-8").splitlines()) <= 400
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


def test_the_pages_speak_the_projects_words() -> None:
    # no tracker numbers or work diaries in what a user reads
    bad = re.compile(r"\bissues? \d+|\bsittings?\b|\(issue|#\d{2,}\b", re.I)
    for page in PAGES:
        hits = [line for line in page.read_text(encoding="utf-8").splitlines() if bad.search(line)]
        assert not hits, (page.name, hits[:3])


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in text.splitlines():
        if m := re.match(r"^#{1,6} (.+)$", line):
            slug = re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_every_link_between_the_pages_resolves() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), (page.name, target)
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest.read_text(encoding="utf-8")), (page.name, target)
