"""The ranking stage's artifacts in the model repository: the DLRM weights and config.

``save`` is what ``recpipe train`` calls; ``load_model`` is what ``RankingCore`` calls. Weights are
safetensors, configs JSON: nothing here unpickles.
"""

from __future__ import annotations

from pathlib import Path

from recpipe.nn import load_state, save_state
from recpipe.ranking.model import DLRM, DLRMConfig
from recpipe.repository import Repository, write_json

DLRM_FILE = "ranking/dlrm.safetensors"
DLRM_CONFIG_FILE = "ranking/dlrm.json"


def save(root: Path, model: DLRM) -> None:
    """Write ``model``'s weights and config under the repository being built at ``root``."""
    (root / "ranking").mkdir(exist_ok=True)
    save_state(root / DLRM_FILE, model)
    write_json(root / DLRM_CONFIG_FILE, model.config.to_json())


def load_config(repo: Repository) -> DLRMConfig:
    return DLRMConfig.from_json(repo.json(DLRM_CONFIG_FILE), str(repo.root / DLRM_CONFIG_FILE))


def load_model(repo: Repository, config: DLRMConfig) -> DLRM:
    """The trained DLRM on the CPU (ArtifactMismatch names the file when the weights do not fit)."""
    model = DLRM(config)
    load_state(repo.file(DLRM_FILE), model)
    return model


__all__ = ["DLRM_CONFIG_FILE", "DLRM_FILE", "load_config", "load_model", "save"]
