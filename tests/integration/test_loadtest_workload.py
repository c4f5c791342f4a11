"""loadtest/workload.py: the gRPC target from --host, and who the load test asks for.

The module is loaded from its file (loadtest/ is a locustfile directory, not a package); it imports
neither locust nor grpc, so loading it here leaves this process's gevent/grpc state alone.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("recpipe_loadtest_workload", ROOT / "loadtest" / "workload.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


workload = _load()


@pytest.mark.parametrize(
    ("host", "target"),
    [
        ("grpc://127.0.0.1:50051", "127.0.0.1:50051"),
        ("127.0.0.1:50051", "127.0.0.1:50051"),
        ("grpc://gateway:50051/", "gateway:50051"),
        ("dns:///gateway:50051", "dns:///gateway:50051"),
        ("ipv4:127.0.0.1:1,127.0.0.2:1", "ipv4:127.0.0.1:1,127.0.0.2:1"),
        ("[::1]:50051", "[::1]:50051"),
    ],
)
def test_target_from_host(host: str, target: str) -> None:
    assert workload.parse_target(host, env={}) == target


def test_target_from_environment_when_no_host() -> None:
    assert workload.parse_target(None, env={"RECPIPE_TARGET": "grpc://h:1"}) == "h:1"
    assert workload.parse_target("a:2", env={"RECPIPE_TARGET": "h:1"}) == "a:2"  # --host wins


@pytest.mark.parametrize("host", ["", "http://127.0.0.1:50051", "127.0.0.1", "127.0.0.1:http", "h:0", "h:70000"])
def test_bad_targets_are_refused_with_the_reason(host: str) -> None:
    with pytest.raises(workload.WorkloadError):
        workload.parse_target(host, env={})


def test_uniform_covers_all_ids() -> None:
    sampler = workload.sampler_from_count(10, "uniform")
    draws = sampler.draw(np.random.default_rng(0), 5000)
    assert draws.dtype == np.int64 and set(draws.tolist()) == set(range(10))


def test_synthetic_zipf_is_heavy_tailed_and_seeded() -> None:
    a = workload.sampler_from_count(1000, "zipf", zipf_s=1.2, seed=3)
    b = workload.sampler_from_count(1000, "zipf", zipf_s=1.2, seed=3)
    da, db = a.draw(np.random.default_rng(1), 20_000), b.draw(np.random.default_rng(1), 20_000)
    assert np.array_equal(da, db)
    counts = np.sort(np.bincount(da, minlength=1000))[::-1]
    assert counts[:10].sum() > 0.3 * counts.sum()  # the top 1% of users send a large share
    assert counts[0] > 50 * max(1, counts[500])


def test_zipf_by_activity_follows_interaction_counts(small_dataset: Path) -> None:
    users = pl.read_parquet(small_dataset / "users.parquet", columns=["user_id"])["user_id"].to_numpy()
    activity = (
        pl.read_parquet(small_dataset / "interactions.parquet", columns=["user_id"])
        .group_by("user_id").len()
    )
    weight = np.ones(users.max() + 1)
    weight[activity["user_id"].to_numpy()] += activity["len"].to_numpy()
    sampler = workload.sampler_from_data(small_dataset, "zipf")
    draws = sampler.draw(np.random.default_rng(0), 200_000)
    assert set(np.unique(draws)) <= set(users.tolist())
    freq = np.bincount(draws, minlength=weight.size) / draws.size
    expected = weight / weight[users].sum()
    # the most active tenth of users is drawn as often as their share of activity says (within 5%)
    top = users[np.argsort(-weight[users])[: max(1, users.size // 10)]]
    assert freq[top].sum() == pytest.approx(expected[top].sum(), rel=0.05)
    assert expected[top].sum() > 0.15  # and that share is well above a uniform tenth


def test_uniform_from_data_draws_every_user_alike(small_dataset: Path) -> None:
    sampler = workload.sampler_from_data(small_dataset, "uniform")
    n = pl.scan_parquet(small_dataset / "users.parquet").select(pl.len()).collect().item()
    assert sampler.user_ids.size == n and sampler.cdf is None


def test_missing_data_and_bad_settings_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(workload.WorkloadError, match=r"users\.parquet"):
        workload.sampler_from_data(tmp_path, "zipf")
    with pytest.raises(workload.WorkloadError, match="distribution"):
        workload.sampler_from_count(10, "pareto")
    with pytest.raises(workload.WorkloadError, match="num-user-ids"):
        workload.sampler_from_count(0, "uniform")
    with pytest.raises(workload.WorkloadError, match="zipf-s"):
        workload.sampler_from_count(10, "zipf", zipf_s=0)
