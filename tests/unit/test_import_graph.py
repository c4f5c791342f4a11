"""The package's layering, read from the source with ``ast``: no stage package imports another or the
training code, nothing in ``serving/`` imports a stage package or the registry or spells a stage's
name, and no library module imports the CLI (``recpipe.commands``).

Stage packages are found through the registry, so a new stage is covered without editing this test.
Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import recpipe
from recpipe.stages import REGISTRY

ROOT = Path(recpipe.__file__).parent
STAGE_PACKAGES = {f"recpipe.{name}" for name in REGISTRY.names}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "recpipe" or name.startswith("recpipe.")}


def _package_of(module: str, packages: set[str]) -> str | None:
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def import_edges() -> list[tuple[str, str]]:
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        if "v1" in path.relative_to(ROOT).parts[:1]:
            continue
        module = _module_name(path)
        edges.extend((module, target) for target in sorted(_imports(path)))
    return edges


def forbidden(edges: list[tuple[str, str]]) -> list[str]:
    bad = []
    for src, dst in edges:
        src_stage, dst_stage = _package_of(src, STAGE_PACKAGES), _package_of(dst, STAGE_PACKAGES)
        if src_stage and dst_stage and src_stage != dst_stage:
            bad.append(f"stage {src} imports stage {dst}")
        if src.startswith("recpipe.serving") and dst_stage:
            bad.append(f"serving module {src} imports stage {dst}")
        if src.startswith("recpipe.serving") and dst.startswith("recpipe.stages"):
            bad.append(f"serving module {src} imports the registry {dst}")
        if src_stage and dst.startswith("recpipe.training"):
            bad.append(f"stage {src} imports training code {dst}")
        if not src.startswith(("recpipe.commands", "recpipe.cli", "recpipe.__main__")) and dst.startswith(
            "recpipe.commands"
        ):
            bad.append(f"library module {src} imports the CLI module {dst}")
    return bad


def test_no_forbidden_imports() -> None:
    edges = import_edges()
    assert len(edges) > 100  # the scan really read the package
    assert forbidden(edges) == []


def test_the_check_catches_each_kind_of_edge() -> None:
    assert forbidden([("recpipe.ranking.core", "recpipe.retrieval.core")]) == [
        "stage recpipe.ranking.core imports stage recpipe.retrieval.core"
    ]
    assert forbidden([("recpipe.serving.runner", "recpipe.features.servicer")]) == [
        "serving module recpipe.serving.runner imports stage recpipe.features.servicer"
    ]
    assert forbidden([("recpipe.bench.chain", "recpipe.commands.serve")]) == [
        "library module recpipe.bench.chain imports the CLI module recpipe.commands.serve"
    ]
    assert forbidden([("recpipe.features.core", "recpipe.training.split")]) == [
        "stage recpipe.features.core imports training code recpipe.training.split"
    ]
    assert forbidden([("recpipe.serving.launch", "recpipe.stages")]) == [
        "serving module recpipe.serving.launch imports the registry recpipe.stages"
    ]
    # within a stage, and from the registry or a command, is allowed
    assert forbidden([("recpipe.ranking.core", "recpipe.ranking.model"), ("recpipe.stages", "recpipe.ranking.servicer"),
                      ("recpipe.commands.serve", "recpipe.stages")]) == []


def stage_name_literals(path: Path) -> list[str]:
    """Every string constant in ``path`` that is exactly a registered stage's name (with its line)."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.name}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in REGISTRY.names]


def test_serving_never_spells_a_stage_name() -> None:
    files = sorted((ROOT / "serving").rglob("*.py"))
    assert len(files) > 10
    assert [hit for path in files for hit in stage_name_literals(path)] == []


def test_the_literal_check_finds_a_stage_name(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text('TARGETS = ("ranking", "some other string")\n')
    assert stage_name_literals(planted) == ["planted.py:1: 'ranking'"]
