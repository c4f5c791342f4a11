"""Shared test fixtures: a tiny dataset, a model repository trained on it, and the real serving chain.

All three are session-scoped and built on first use, so every test module that asks for them shares
one copy (building them costs a few seconds; tests that do not ask pay nothing).

``small_dataset`` -> Path
    ``recpipe synth-data --out DIR --scale TEST_SCALE --quiet`` run through ``recpipe.cli.main``.
``small_models`` -> Path
    ``recpipe train --data small_dataset --out DIR --epochs 1`` (a real, if barely trained, repository).
``serving_chain`` -> ``recpipe.inprocess.ChainServers``
    The real features, retrieval and ranking stages (over ``small_models``/``small_dataset``) and a
    gateway, each a real gRPC server on a free port of 127.0.0.1, loaded and SERVING (the gateway's
    health included, which follows the stages' health a moment after they load), running in this
    process on a background event loop. Use ``serving_chain.gateway.address`` (or ``.targets``:
    gateway/features/retrieval/ranking -> "127.0.0.1:PORT") with any gRPC client, e.g.
    ``recpipe.client.RecommendClient(serving_chain.gateway.address)``. Do not stop its servers: other
    modules share them; start your own with ``serving_threads`` + ``start_chain`` if you need to.
``serving_threads`` -> ``recpipe.serving.server.ServerThread``
    The loop hosting ``serving_chain``; ``serving_threads.start(stage)`` adds servers of your own
    (stop them with ``serving_threads.stop(server)``).
``dataset_info`` -> dict
    ``num_users`` and ``num_items`` of ``small_dataset`` (read from the feature stage's InfoService).
``quick_characterization`` -> ``Characterization`` (tests name its type ``Any``: ``conftest`` is not
    importable by that name from every directory)
    The README's ``recpipe characterize --out char-a --data data --models models --threads 1 --quick``
    over ``small_dataset``/``small_models``, with ``--device cpu``: its directory (``out``) and what it
    printed (``stdout``, ``stderr``). About 20 s, so it runs once: tests that change it copy it first.
``bf16_ranking`` -> ``recpipe.ranking.core.RankingCore``
    ``RankingCore.load(small_models, device="cpu", precision="bf16")`` with bf16 taken as native whatever
    this CPU has (emulated where it is not: slower, the same shapes and the same compiler), so every
    machine kind runs the compiled path. Compiling and warming its 33 shapes costs 10-15 s, so it loads
    once; its users only rank with it.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from recpipe.inprocess import ChainServers
    from recpipe.ranking.core import RankingCore
    from recpipe.serving.server import ServerThread

#: Scale of the shared test dataset (1.0 = 221k users, 850k items, 4M interactions).
TEST_SCALE = 0.005


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from recpipe.cli import main

    out = tmp_path_factory.mktemp("recpipe-data") / "data"
    rc = main(["synth-data", "--out", str(out), "--scale", str(TEST_SCALE), "--quiet"])
    if rc != 0:
        pytest.fail(f"recpipe synth-data failed with exit code {rc}")
    return out


@pytest.fixture(scope="session")
def small_models(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from recpipe.cli import main

    out = tmp_path_factory.mktemp("recpipe-models") / "models"
    rc = main(["train", "--data", str(small_dataset), "--out", str(out), "--epochs", "1"])
    if rc != 0:
        pytest.fail(f"recpipe train failed with exit code {rc}")
    return out


@dataclass(frozen=True)
class Characterization:
    out: Path
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def quick_characterization(small_dataset: Path, small_models: Path,
                           tmp_path_factory: pytest.TempPathFactory) -> Characterization:
    from recpipe.cli import main

    out = tmp_path_factory.mktemp("recpipe-characterization") / "char-a"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["characterize", "--out", str(out), "--data", str(small_dataset), "--models", str(small_models),
                   "--threads", "1", "--quick", "--device", "cpu"])
    if rc != 0:
        pytest.fail(f"recpipe characterize failed with exit code {rc}: {stderr.getvalue()[-2000:]}")
    return Characterization(out, stdout.getvalue(), stderr.getvalue())


@pytest.fixture(scope="session")
def bf16_ranking(small_models: Path) -> RankingCore:
    from recpipe.ranking import precision
    from recpipe.ranking.core import RankingCore

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precision, "native_bf16", lambda flags=None: True)
        return RankingCore.load(small_models, device="cpu", precision="bf16")


@pytest.fixture(scope="session")
def serving_threads() -> Iterator[ServerThread]:
    from recpipe.serving.server import ServerThread

    st = ServerThread()
    yield st
    st.close()


@pytest.fixture(scope="session")
def serving_chain(serving_threads: ServerThread, small_models: Path, small_dataset: Path) -> ChainServers:
    from recpipe.inprocess import start_chain

    chain = start_chain(serving_threads, small_models, small_dataset, device="cpu", metrics=True)
    wait_serving(chain.gateway.address)
    return chain


def wait_serving(address: str, timeout: float = 30.0) -> None:
    """Block until the server at ``address`` reports SERVING on its gRPC health service."""
    import time

    import grpc

    from recpipe.serving.supervisor import health_status

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        while health_status(channel) != "SERVING":
            if time.monotonic() > deadline:
                pytest.fail(f"{address} not SERVING after {timeout}s")
            time.sleep(0.05)


@pytest.fixture(scope="session")
def dataset_info(serving_chain: ChainServers) -> dict[str, int]:
    from recpipe.client import RecommendClient

    with RecommendClient(serving_chain.features.address) as client:
        details = client.info().details
    return {"num_users": int(details["num_users"]), "num_items": int(details["num_items"])}
