"""Fixtures of the unit tests that need a loaded feature core (the GPU fast-path tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recpipe.features.core import FeatureCore


@pytest.fixture(scope="module")
def features(small_models: Path, small_dataset: Path) -> FeatureCore:
    return FeatureCore.load(small_models, small_dataset)
