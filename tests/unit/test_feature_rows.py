"""The feature stage's precomputed rows: written by training, mapped at load, the same answers as
computing them from the dataset."""

from __future__ import annotations

import mmap
import platform
from pathlib import Path

import numpy as np
import pytest

from recpipe.errors import ArtifactMismatch
from recpipe.features import artifacts
from recpipe.features.core import FeatureCore, read_tables
from recpipe.repository import Repository
from recpipe.safetensors_map import map_safetensors
from recpipe.timesplit import split_by_time


def _owner(array: np.ndarray) -> object:
    """The object at the end of a view's ``base`` chain (what holds the memory)."""
    base: object = array
    while isinstance(base, np.ndarray | memoryview):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return base


def test_rows_are_mapped_and_answer_as_the_dataset_computed_core(small_models: Path, small_dataset: Path) -> None:
    repo = Repository.open(small_models)
    assert artifacts.ROWS_FILE in repo.manifest["files"]
    mapped = FeatureCore.load(small_models, small_dataset)
    assert isinstance(_owner(mapped.user_dense), mmap.mmap)  # a view of the file's mapping, not a copy
    assert not mapped.user_dense.flags.writeable  # read-only pages of the file
    users, items, interactions = read_tables(small_dataset)
    train, _ = split_by_time(interactions)
    computed = FeatureCore(artifacts.load_preprocessor(repo), users, items, train, artifacts.load_config(repo),
                           repo.version)
    assert mapped.describe() == computed.describe()
    rng = np.random.default_rng(0)
    for user in rng.integers(0, computed.num_users, 20):
        a, b = mapped.augment_user(int(user)), computed.augment_user(int(user))
        np.testing.assert_array_equal(a.dense, b.dense)
        np.testing.assert_array_equal(a.sparse, b.sparse)
        np.testing.assert_array_equal(a.recent_items, b.recent_items)
        ids = rng.integers(0, computed.num_items, 50)
        x, y = mapped.augment_items(int(user), ids), computed.augment_items(int(user), ids)
        np.testing.assert_array_equal(x.dense, y.dense)
        np.testing.assert_array_equal(x.sparse, y.sparse)
    # the training-set builders read the same continuous columns
    ids = np.arange(min(30, computed.num_users))
    np.testing.assert_array_equal(mapped.user_dense_rows(ids), computed.user_dense_rows(ids))


def test_map_safetensors_round_trips_and_names_a_corrupt_file(tmp_path: Path) -> None:
    arrays = {"a": np.arange(12, dtype=np.int64).reshape(3, 4), "b": np.linspace(0, 1, 5, dtype=np.float32),
              "empty": np.zeros((0, 3), np.int64)}
    (tmp_path / "features").mkdir()
    artifacts.save_rows(tmp_path, arrays, {"k": "v"})
    got, meta = map_safetensors(tmp_path / artifacts.ROWS_FILE)
    assert meta == {"k": "v"} and sorted(got) == sorted(arrays)
    for name, want in arrays.items():
        assert got[name].dtype == want.dtype
        np.testing.assert_array_equal(got[name], want)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((1000).to_bytes(8, "little") + b"{not json")
    with pytest.raises(ArtifactMismatch, match=r"bad\.safetensors: unreadable"):
        map_safetensors(bad)


def test_a_prefaulted_mapping_reads_the_same_and_the_kernel_populates_it(tmp_path: Path) -> None:
    from recpipe.safetensors_map import populate

    arrays = {"a": np.arange(300_000, dtype=np.int64)}
    (tmp_path / "features").mkdir()
    artifacts.save_rows(tmp_path, arrays, {})
    got, _ = map_safetensors(tmp_path / artifacts.ROWS_FILE, prefault=True)
    np.testing.assert_array_equal(got["a"], arrays["a"])
    assert not got["a"].flags.writeable
    with open(tmp_path / artifacts.ROWS_FILE, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # MADV_POPULATE_READ exists from Linux 5.14; before that the kernel says no and populate says False
    release = tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit())
    assert populate(buf, chunk=1 << 16) is (release >= (5, 14))
    buf.close()


def test_populate_advises_every_chunk_once_and_stops_where_the_kernel_refuses() -> None:
    from recpipe.safetensors_map import populate

    class Mapping:
        def __init__(self, size: int, refuse_at: int | None = None) -> None:
            self.size, self.refuse_at, self.calls = size, refuse_at, []

        def __len__(self) -> int:
            return self.size

        def madvise(self, option: int, start: int, length: int) -> None:
            self.calls.append((start, length))
            if start == self.refuse_at:
                raise OSError(22, "Invalid argument")

    whole = Mapping(10_000)
    assert populate(whole, chunk=4096) is True  # type: ignore[arg-type]
    assert whole.calls == [(0, 4096), (4096, 4096), (8192, 1808)]
    refused = Mapping(10_000, refuse_at=4096)
    assert populate(refused, chunk=4096) is False  # type: ignore[arg-type]
    assert refused.calls == [(0, 4096), (4096, 4096)]
