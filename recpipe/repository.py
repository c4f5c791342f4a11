"""The model repository: ``MODELS_DIR/manifest.json`` lists every artifact with its sha256.

``write_manifest`` seals a directory written by training; ``Repository.open`` reads it back and
hands out verified paths (``repo.file(name)`` checks the checksum before anyone reads the file), so a
corrupt, missing or foreign artifact raises ``ArtifactMismatch`` naming the file instead of failing
somewhere inside torch or faiss. The dataset a repository was trained on is identified by
``dataset_sha256``, a hash over the data manifest's per-file checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from recpipe.datagen.manifest import dataset_sha256, sha256_file
from recpipe.datagen.manifest import load_manifest as read_data_manifest
from recpipe.errors import ArtifactMismatch, UsageError, clip
from recpipe.files import write_atomic

MANIFEST = "manifest.json"
DATA_MANIFEST = "manifest.json"
REPOSITORY_FORMAT = 1
#: The placeholder README tracked in git as ``models/README.md``: recognised by its text, kept by train.
PLACEHOLDER_README = "README.md"
_PLACEHOLDER_TEXT = "written by `recpipe train`"
_PLACEHOLDER_MAX_BYTES = 4096


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object; a missing or malformed file is an ``ArtifactMismatch`` naming it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactMismatch(f"{path}: file is missing") from None
    except (OSError, ValueError) as e:
        raise ArtifactMismatch(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ArtifactMismatch(f"{path}: expected a JSON object")
    return data


def write_json(path: Path, data: Any) -> None:
    """Write an artifact's JSON (into a repository being built, so replacing is expected)."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", force=True)


def write_manifest(root: Path, content: dict[str, Any]) -> dict[str, Any]:
    """Checksum every file under ``root`` and write ``root/manifest.json`` = ``content`` + files + version.

    ``version`` is a short hash over the artifacts' checksums: same artifacts, same version.
    """
    root = Path(root)
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = path.relative_to(root).as_posix()
        files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    version = hashlib.sha256(
        json.dumps({k: v["sha256"] for k, v in files.items()}, sort_keys=True).encode()
    ).hexdigest()[:12]
    manifest = {**content, "format": REPOSITORY_FORMAT, "files": files, "version": version}
    write_json(root / MANIFEST, manifest)
    return manifest


def is_placeholder(path: Path) -> bool:
    """Whether ``path`` is recpipe's own placeholder README (a small README.md that says what the
    directory is for), which ``recpipe train`` keeps rather than counting it as someone else's file."""
    path = Path(path)
    try:
        if path.name != PLACEHOLDER_README or path.is_symlink() or not path.is_file() or \
                path.stat().st_size > _PLACEHOLDER_MAX_BYTES:
            return False
        return _PLACEHOLDER_TEXT in path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False


def foreign_entries(root: Path) -> list[str]:
    """What under ``root`` is not part of a recpipe model repository, as sorted relative paths.

    Ours are ``manifest.json`` (when it is a repository manifest), the files it lists and the
    directories holding them, and the placeholder README at the top. Anything else, including a
    symlink or an empty directory, belongs to someone else: ``train --force`` must not delete it.
    """
    root = Path(root)
    files: set[str] = set()
    manifest_path = root / MANIFEST
    if manifest_path.is_file() and not manifest_path.is_symlink():
        try:
            manifest = read_json(manifest_path)
        except ArtifactMismatch:
            manifest = {}
        listed = manifest.get("files")
        if manifest.get("format") == REPOSITORY_FORMAT and isinstance(listed, dict):
            files = {str(name) for name in listed} | {MANIFEST}
    dirs = {str(parent) for name in files for parent in PurePosixPath(name).parents if str(parent) != "."}
    foreign = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = here.relative_to(root)
        for name in (*dirnames, *filenames):
            rel = (rel_dir / name).as_posix()
            path = here / name
            if path.is_symlink():
                foreign.append(rel)
            elif path.is_dir():
                if rel not in dirs:
                    foreign.append(rel)
            elif rel not in files and not (rel == PLACEHOLDER_README and is_placeholder(path)):
                foreign.append(rel)
        dirnames[:] = [d for d in dirnames if (rel_dir / d).as_posix() in dirs and not (here / d).is_symlink()]
    return sorted(foreign)


def check_replaceable(out: Path, force: bool) -> None:
    """``UsageError`` unless ``recpipe train`` may write a repository to ``out``: it is absent, empty,
    holds only the placeholder README, or holds a model repository and ``force`` is set. A directory
    holding anything else is refused even with ``force``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if not out.is_dir():
        return
    foreign = foreign_entries(out)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise UsageError(
            f"--out {out} holds files that are not part of a recpipe model repository "
            f"({clip(', '.join(foreign[:3]))}{more}); not replacing it, even with --force: "
            "choose a new or empty directory"
        )
    if (out / MANIFEST).exists() and not force:
        raise UsageError(f"--out {out} already holds a model repository; pass --force to replace it")


def _check_listing(path: Path, manifest: dict[str, Any]) -> None:
    """The manifest's ``files`` maps names to {sha256, bytes}, ``version``/``dataset_sha256`` are strings
    and ``shapes`` integers: an edited manifest is an ``ArtifactMismatch`` here, not an AttributeError or
    a ValueError in a stage."""
    for key in ("version", "dataset_sha256"):
        if not isinstance(manifest[key], str):
            raise ArtifactMismatch(f"{path}: manifest {key!r} is not a string")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise ArtifactMismatch(f"{path}: manifest 'files' is not an object of name -> {{sha256, bytes}}")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and type(entry.get("bytes")) is int):
            raise ArtifactMismatch(f"{path}: manifest entry for {clip(str(name))!r} is not {{sha256, bytes}}")
    shapes = manifest.get("shapes", {})
    bad = [str(k) for k, v in shapes.items() if type(v) is not int] if isinstance(shapes, dict) else ["(all)"]
    if bad:  # the stages compare their pieces against these as integers
        raise ArtifactMismatch(f"{path}: manifest shapes {clip(', '.join(bad))} are not integers")


@dataclass
class Repository:
    """An opened model repository. ``file(name)`` returns a verified path; ``section(key)`` a manifest part."""

    root: Path
    manifest: dict[str, Any]
    _verified: set[str] = field(default_factory=set)

    @classmethod
    def open(cls, root: Path) -> Repository:
        root = Path(root)
        path = root / MANIFEST
        if not path.exists():
            raise ArtifactMismatch(f"{path}: model repository manifest is missing (run `recpipe train --out {root}`)")
        manifest = read_json(path)
        if "schema_version" in manifest and "format" not in manifest:  # ``recpipe synth-data``'s manifest
            raise ArtifactMismatch(f"{root} is a dataset (recpipe synth-data), not a model repository (recpipe "
                                   "train --out): swapped --data and --models?")
        for key in ("files", "version", "dataset_sha256"):
            if key not in manifest:
                raise ArtifactMismatch(f"{path}: manifest has no {key!r}")
        if manifest.get("format") != REPOSITORY_FORMAT:
            raise ArtifactMismatch(f"{path}: unsupported repository format {manifest.get('format')!r}")
        _check_listing(path, manifest)
        return cls(root, manifest)

    @property
    def version(self) -> str:
        return str(self.manifest["version"])

    @property
    def dataset_sha256(self) -> str:
        return str(self.manifest["dataset_sha256"])

    def section(self, key: str) -> dict[str, Any]:
        value = self.manifest.get(key)
        if not isinstance(value, dict):
            raise ArtifactMismatch(f"{self.root / MANIFEST}: manifest has no {key!r} section")
        return value

    def file(self, name: str) -> Path:
        """Path of artifact ``name`` after checking it exists and matches its recorded sha256."""
        path = self.root / name
        entry = self.manifest["files"].get(name)
        if entry is None:
            raise ArtifactMismatch(f"{path}: not listed in {self.root / MANIFEST}")
        if name in self._verified:
            return path
        self._present(name)
        if path.stat().st_size != entry.get("bytes") or sha256_file(path) != entry.get("sha256"):
            raise ArtifactMismatch(f"{path}: sha256 does not match {self.root / MANIFEST} (file changed or corrupt)")
        self._verified.add(name)
        return path

    def _present(self, name: str) -> Path:
        """Path of listed artifact ``name`` after checking a file is there (``ArtifactMismatch`` if not)."""
        path = self.root / name
        if not path.is_file():
            raise ArtifactMismatch(f"{path}: artifact is missing")
        return path

    def json(self, name: str) -> dict[str, Any]:
        return read_json(self.file(name))

    def check_present(self) -> None:
        """Every listed artifact is there at its recorded size (cheap, no hashing: ``file`` checks the
        sha256 where a stage reads it)."""
        for name, entry in self.manifest["files"].items():
            path = self._present(name)
            if path.stat().st_size != entry.get("bytes"):
                raise ArtifactMismatch(f"{path}: {path.stat().st_size} bytes, {self.root / MANIFEST} says "
                                       f"{entry.get('bytes')} (file changed or truncated)")

    def check_dataset(self, data_dir: Path) -> dict[str, Any]:
        """The data dir's manifest must be the dataset this repository was trained on."""
        data_manifest = read_data_manifest(data_dir)
        if dataset_sha256(data_manifest) != self.dataset_sha256:
            raise ArtifactMismatch(
                f"{Path(data_dir) / DATA_MANIFEST}: dataset does not match the one the models in {self.root} "
                f"were trained on (dataset_sha256 {dataset_sha256(data_manifest)[:12]} != {self.dataset_sha256[:12]})"
            )
        return data_manifest


def check_serving(models: Path, data: Path) -> None:
    """Before a chain starts (``recpipe serve``, ``recpipe demo``): the repository opens, was trained on
    ``data``, and holds every artifact at its size, so that a bad one is one line (exit 2) from the
    command instead of a stage dying after the others started (each stage still verifies the checksums
    of what it reads)."""
    repo = Repository.open(models)
    repo.check_dataset(data)
    repo.check_present()
