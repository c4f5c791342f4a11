"""The feature stage's artifacts in the model repository: the fitted preprocessing (category
vocabularies and normalisation statistics, Parquet/JSON) and the feature configuration (JSON).

``save`` is what ``recpipe train`` calls; the loaders are what ``FeatureCore.load`` calls. Nothing here
unpickles.

``rows.safetensors`` holds what ``FeatureCore`` otherwise computes at every start from the dataset
(the encoded user/item rows, the history counts and the cross tables: ~10 s at full scale on a 2-core
box): training writes it once, a stage maps it (``recpipe.safetensors_map``: the arrays are read-only
views of the file's pages, nothing is copied) and never reads the dataset's Parquet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from recpipe.errors import ArtifactMismatch
from recpipe.preprocess import Preprocessor
from recpipe.repository import Repository, write_json
from recpipe.safetensors_map import map_safetensors

CONFIG_FILE = "features/config.json"
ROWS_FILE = "features/rows.safetensors"
PREPROCESS_FILES = {
    "stats": "preprocess/stats.json",
    "users": "preprocess/vocab_users.parquet",
    "items": "preprocess/vocab_items.parquet",
}


@dataclass(frozen=True)
class FeatureConfig:
    """``num_*``: id ranges of the raw columns keying the cross tables (0 = take them from the data)."""

    history_len: int = 20
    num_categories: int = 0
    num_top_categories: int = 0

    def __post_init__(self) -> None:
        if self.history_len < 0:
            raise ValueError("history_len must be >= 0")


def save(root: Path, preprocessor: Preprocessor, config: FeatureConfig) -> None:
    """Write the fitted preprocessing and the feature configuration under ``root``."""
    preprocessor.save(root / "preprocess")
    (root / "features").mkdir(exist_ok=True)
    write_json(root / CONFIG_FILE, asdict(config))


def load_config(repo: Repository) -> FeatureConfig:
    raw = repo.json(CONFIG_FILE)
    try:
        return FeatureConfig(int(raw["history_len"]), int(raw["num_categories"]), int(raw["num_top_categories"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactMismatch(f"{repo.root / CONFIG_FILE}: malformed ({e!r})") from None


def load_preprocessor(repo: Repository) -> Preprocessor:
    """The fitted preprocessing (verified files)."""
    return Preprocessor.load(
        repo.file(PREPROCESS_FILES["stats"]),
        {"users": repo.file(PREPROCESS_FILES["users"]), "items": repo.file(PREPROCESS_FILES["items"])},
    )


def save_rows(root: Path, arrays: dict[str, np.ndarray], meta: dict[str, str]) -> None:
    """Write the feature core's precomputed arrays (``FeatureCore.rows``) under ``root``."""
    from safetensors.numpy import save_file

    (root / "features").mkdir(exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(root / ROWS_FILE), metadata=meta)


def load_rows(repo: Repository) -> tuple[dict[str, np.ndarray], dict[str, str]] | None:
    """The precomputed arrays and their metadata, mapped read-only; None for a repository trained
    before they were written (the core then computes them from the dataset)."""
    if ROWS_FILE not in repo.manifest["files"]:
        return None
    return map_safetensors(repo.file(ROWS_FILE), prefault=True)
