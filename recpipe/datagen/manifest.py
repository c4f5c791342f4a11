"""Reading and checking a dataset's ``manifest.json`` (used by training and serving too)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from recpipe import schema
from recpipe.datagen.writer import MANIFEST_NAME
from recpipe.errors import ArtifactMismatch

REQUIRED_KEYS = ("schema_version", "seed", "scale", "rows", "sha256", "oracle")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def dataset_sha256(manifest: dict[str, Any]) -> str:
    """Identity of a dataset: sha256 over its files' checksums (names sorted)."""
    files = manifest["sha256"]
    canon = json.dumps({str(k): str(v) for k, v in sorted(files.items())}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()


def load_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The manifest of the dataset in ``data_dir``; ArtifactMismatch naming the file if unusable."""
    path = Path(data_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactMismatch(f"{path}: dataset manifest is missing (is {data_dir} a `recpipe synth-data` "
                               "output?)") from None
    except (OSError, ValueError) as e:
        raise ArtifactMismatch(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise ArtifactMismatch(f"{path}: expected a JSON object")
    if "schema_version" not in manifest and "format" in manifest:  # a model repository's (``recpipe train``)
        raise ArtifactMismatch(f"{data_dir} is a model repository (recpipe train --out), not a dataset (recpipe "
                               "synth-data): swapped --data and --models?")
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ArtifactMismatch(f"{path}: missing keys {', '.join(missing)}")
    if manifest["schema_version"] != schema.SCHEMA_VERSION:
        raise ArtifactMismatch(f"{path}: schema_version {manifest['schema_version']!r}, this recpipe reads "
                               f"{schema.SCHEMA_VERSION}; regenerate the data with `recpipe synth-data`")
    sums = manifest["sha256"]
    if not isinstance(sums, dict) or sorted(sums) != sorted(schema.TABLE_FILES.values()):
        raise ArtifactMismatch(f"{path}: 'sha256' must list {', '.join(sorted(schema.TABLE_FILES.values()))}")
    wrong = _wrong_types(manifest)
    if wrong:  # training reads these after hours of work, and prints the oracle's numbers
        raise ArtifactMismatch(f"{path}: {', '.join(wrong)} of the wrong type (an edited manifest?)")
    return manifest


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _wrong_types(manifest: dict[str, Any]) -> list[str]:
    """The keys training reads that do not hold what ``recpipe synth-data`` writes there."""
    oracle, rows = manifest["oracle"], manifest["rows"]
    wrong = [] if isinstance(manifest["seed"], int) and not isinstance(manifest["seed"], bool) else ["seed"]
    wrong += [] if _is_number(manifest["scale"]) else ["scale"]
    wrong += [] if isinstance(rows, dict) and all(_is_number(v) for v in rows.values()) else ["rows"]
    if not isinstance(oracle, dict):
        return [*wrong, "oracle"]
    return wrong + [f"oracle.{k}" for k in ("auc", "recall_at_500") if not (oracle.get(k) is None or _is_number(oracle[k]))]


def verify(data_dir: str | Path, names: list[str] | None = None) -> dict[str, Any]:
    """Load the manifest and check the files (all, or ``names``) against their sha256; returns it."""
    manifest = load_manifest(data_dir)
    for name in names if names is not None else sorted(manifest["sha256"]):
        path = Path(data_dir) / name
        expected = manifest["sha256"].get(name)
        if expected is None:
            raise ArtifactMismatch(f"{path}: not listed in {Path(data_dir) / MANIFEST_NAME}")
        if not path.is_file():
            raise ArtifactMismatch(f"{path}: dataset file is missing")
        if sha256_file(path) != expected:
            raise ArtifactMismatch(f"{path}: sha256 does not match the dataset manifest (changed or corrupt)")
    return manifest
