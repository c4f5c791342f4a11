"""The retrieval stage on the CPU never imports torch (``import torch`` alone is 1-4 s of its cold start):
the user tower is read folded into numpy, bit for bit the fold of the torch tower (its answers equal
the torch tower's to float rounding), and the stage sizes
only the thread pools it loads. Paths that need torch (CUDA, fp16/bf16 exact search, graphs) still load it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from recpipe.accel import device as devices
from recpipe.features.core import FeatureCore
from recpipe.repository import Repository
from recpipe.retrieval import artifacts
from recpipe.retrieval.config import TwoTowerConfig
from recpipe.retrieval.contract import RetrieveQuery
from recpipe.retrieval.core import RetrievalCore
from recpipe.retrieval.folded import user_tower_shapes
from recpipe.retrieval.model import Tower
from recpipe.retrieval.options import RetrievalOptions
from recpipe.stages import REGISTRY

ROOT = Path(__file__).resolve().parents[2]

#: Builds the retrieval stage as ``recpipe serve --stage retrieval --device cpu --threads 1`` does, loads
#: it, answers the queries in argv[2] into argv[3], and reports what the process imported.
CHILD = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    import numpy as np
    from recpipe.retrieval.contract import RetrieveQuery
    from recpipe.stages import REGISTRY

    stage = REGISTRY.build(REGISTRY.config("retrieval", models_dir=Path(sys.argv[1]), device="cpu", threads=1))
    asyncio.run(stage.load())
    core = stage._ready()
    q = np.load(sys.argv[2])
    found = core.retrieve_batch([RetrieveQuery.checked(d, s, 50, core.limits) for d, s in zip(q["dense"], q["sparse"])])
    np.savez(sys.argv[3], ids=np.stack([f.item_ids for f in found]), scores=np.stack([f.scores for f in found]))
    info = stage.info()
    print(json.dumps({"torch": "torch" in sys.modules, "threads": info.threads, "device": info.device,
                      "details": info.details}))
""")


def _assert_same_ranking(ids: np.ndarray, want_ids: np.ndarray, want_scores: np.ndarray, tie: float = 1e-6) -> None:
    """The same item at every rank, except where two scores of a row are within rounding of each other
    (such a pair may come out in either order)."""
    gaps = np.diff(want_scores, axis=1)
    tied = np.zeros(want_scores.shape, bool)
    tied[:, 1:] |= np.abs(gaps) <= tie
    tied[:, :-1] |= np.abs(gaps) <= tie
    np.testing.assert_array_equal(ids[~tied], want_ids[~tied])
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.sort(want_ids, axis=1))


@pytest.fixture(scope="module")
def queries(features: FeatureCore) -> tuple[np.ndarray, np.ndarray]:
    users = [features.augment_user(u) for u in range(min(40, features.num_users))]
    return np.stack([u.dense for u in users]), np.stack([u.sparse for u in users])


def test_a_cpu_retrieval_stage_never_imports_torch_and_answers_as_the_torch_tower(
        small_models: Path, tmp_path: Path, queries: tuple[np.ndarray, np.ndarray]) -> None:
    dense, sparse = queries
    np.savez(tmp_path / "q.npz", dense=dense, sparse=sparse)
    run = subprocess.run([sys.executable, "-c", CHILD, str(small_models), str(tmp_path / "q.npz"),
                          str(tmp_path / "a.npz")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    child = json.loads(run.stdout.strip().splitlines()[-1])
    assert child["torch"] is False
    assert child["threads"] == 1 and child["device"] == "cpu"  # FAISS's OpenMP threads, sized by --threads
    got = np.load(tmp_path / "a.npz")

    # the same answers as a core loaded here (with torch imported) and the same details. To float
    # rounding, not bit for bit: the child computes on 1 BLAS/OpenMP thread, this process on the
    # session's, and a batch of 40 queries goes through BLAS in both the tower and FAISS, whose sums
    # then run in another order (seen in CI: 1 ulp on 5% of the scores).
    here = RetrievalCore.load(small_models, device="cpu")
    assert {k: v for k, v in child["details"].items() if k in here.details} == here.details
    assert here.details["user_tower"] == "folded-numpy" and here.details["cuda_graphs"] == "eager"
    want = here.retrieve_batch([RetrieveQuery.checked(d, s, 50, here.limits) for d, s in zip(dense, sparse, strict=True)])
    want_ids, want_scores = np.stack([w.item_ids for w in want]), np.stack([w.scores for w in want])
    np.testing.assert_allclose(got["scores"], want_scores, rtol=0, atol=1e-6)
    _assert_same_ranking(got["ids"], want_ids, want_scores)

    # and as the torch tower's query vectors searched in the same index
    with torch.inference_mode():
        vectors = here.tower(torch.from_numpy(dense), torch.from_numpy(sparse)).numpy()
    scores, ids = here._search(vectors, 50, 0, 0)
    np.testing.assert_allclose(got["scores"], scores, rtol=1e-5, atol=1e-6)
    _assert_same_ranking(got["ids"], ids, scores, tie=1e-5)


def test_the_tower_read_without_torch_is_the_torch_towers_fold_bit_for_bit(
        small_models: Path, queries: tuple[np.ndarray, np.ndarray]) -> None:
    repo = Repository.open(small_models)
    cfg = artifacts.load_config(repo)
    read = artifacts.load_folded_user_tower(repo, cfg)
    fold = artifacts.load_user_tower(repo, cfg).folded()
    for name in ("offsets", "proj", "w_dense", "b1"):
        np.testing.assert_array_equal(getattr(read, name), getattr(fold, name))
    dense, sparse = queries
    np.testing.assert_array_equal(read(dense, sparse), fold(dense, sparse))


def test_the_expected_shapes_are_the_torch_towers_state() -> None:
    cfg = TwoTowerConfig(5, 2, (3, 7, 2), (4,), embedding_dim=4, hidden_dims=(16, 8), out_dim=6)
    tower = Tower(cfg.user_dense_dim, cfg.user_table_sizes, cfg.embedding_dim, cfg.hidden_dims, cfg.out_dim)
    assert user_tower_shapes(cfg) == {k: tuple(v.shape) for k, v in tower.state_dict().items()}


def test_cpu_is_decided_without_torch_only_when_certain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    driver = tmp_path / "nvidiactl"
    monkeypatch.setattr(devices, "GPU_DRIVER_FILES", (str(driver),))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.no_gpu() and devices.certainly_cpu("auto") and devices.certainly_cpu(" CPU ")
    assert not devices.certainly_cpu("cuda") and not devices.certainly_cpu("cuda:1")
    driver.touch()  # a driver: auto may be CUDA, torch decides
    assert not devices.no_gpu() and not devices.certainly_cpu("auto") and devices.certainly_cpu("cpu")
    for hidden in ("", "-1", " -1,0"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert devices.no_gpu(), hidden
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not devices.no_gpu()
    assert devices.resolve_name("cpu") == "cpu" and devices.kind("cuda:0") == "cuda"
    assert devices.describe("cpu") == devices.describe(torch.device("cpu")) == "cpu"


def test_the_stage_sizes_torch_only_where_the_core_loads_it() -> None:
    spec = REGISTRY.get("retrieval")
    for device, precision, loads in (("cpu", "auto", ("faiss",)), ("cpu", "fp32", ("faiss",)),
                                     ("cpu", "fp16", ("torch", "faiss")), ("cpu", "bf16", ("torch", "faiss")),
                                     ("cuda", "auto", ("torch", "faiss")), ("cuda:0", "fp32", ("torch", "faiss"))):
        cfg = REGISTRY.config("retrieval", device=device, options=RetrievalOptions(precision=precision))
        assert spec.libraries(cfg) == loads, (device, precision)
    # a stage that declares nothing per configuration sizes every library it names
    ranking = REGISTRY.get("ranking")
    assert ranking.libraries(REGISTRY.config("ranking", device="cpu")) == ranking.threads
