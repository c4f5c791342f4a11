"""Synthetic users/items/interactions with planted structure, and the oracle that scores it.

``generate(DatagenConfig(scale, seed), out_dir)`` writes ``users.parquet``, ``items.parquet``,
``interactions.parquet`` and ``manifest.json`` atomically and returns the manifest;
``load_manifest(dir)`` / ``verify(dir)`` read and check a dataset (ArtifactMismatch names the file).
"""

from __future__ import annotations

from recpipe.datagen.config import DatagenConfig
from recpipe.datagen.generate import generate
from recpipe.datagen.manifest import dataset_sha256, load_manifest, verify

__all__ = ["DatagenConfig", "dataset_sha256", "generate", "load_manifest", "verify"]
