"""Fixtures of the unit tests that need a loaded feature core (the GPU fast-path and training tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from recpipe.features.core import FeatureCore
from recpipe.features.history import RowCounts


@pytest.fixture(scope="module")
def features(small_models: Path, small_dataset: Path) -> FeatureCore:
    return FeatureCore.load(small_models, small_dataset)


NoiseRows = tuple[FeatureCore, np.ndarray, np.ndarray, np.ndarray, RowCounts]


@pytest.fixture(scope="module")
def noise_rows(features: FeatureCore) -> Callable[[int, int], NoiseRows]:
    """``(n, seed)`` -> (core, users, items, labels, counts): n random user-item rows in time order with
    labels that are pure noise (click rate 0.3), and their strictly-earlier history counts."""

    def make(n: int, seed: int) -> NoiseRows:
        rng = np.random.default_rng(seed)
        users, items = rng.integers(0, features.num_users, n), rng.integers(0, features.num_items, n)
        labels = (rng.random(n) < 0.3).astype(np.int64)
        counts = features.training_counts(pl.DataFrame({"user_id": users, "item_id": items, "label": labels,
                                                        "timestamp": np.arange(n)}))
        return features, users, items, labels, counts

    return make
