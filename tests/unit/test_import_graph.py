"""The package's layering, read from the source with ``ast``: no stage package imports another, nothing
in ``serving/`` imports a stage package, and no library module imports the CLI (``recpipe.commands``).

Stage packages are found through the registry, so a new stage is covered without editing this test.
Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import recpipe
from recpipe.stages import REGISTRY

ROOT = Path(recpipe.__file__).parent
STAGE_PACKAGES = {f"recpipe.{name}" for name in REGISTRY}


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
    # within a stage, and from the registry or a command, is allowed
    assert forbidden([("recpipe.ranking.core", "recpipe.ranking.model"), ("recpipe.stages", "recpipe.ranking.servicer"),
                      ("recpipe.commands.serve", "recpipe.stages")]) == []
