"""Fixtures the integration modules share: one server thread per module, and the toy stages' world."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from toy_stages import ToyWorld

from recpipe.serving.server import ServerThread


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerThread]:
    """An event loop in a thread of its own hosting the module's in-process servers."""
    with ServerThread() as st:
        yield st


@pytest.fixture(scope="module")
def world() -> ToyWorld:
    return ToyWorld()
