"""The model repository: checksums, consistency between pieces, clear ArtifactMismatch naming the file."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from recpipe.errors import ArtifactMismatch
from recpipe.features.core import FeatureCore
from recpipe.ranking.core import RankingCore
from recpipe.repository import MANIFEST, Repository, read_json, write_manifest
from recpipe.retrieval.core import RetrievalCore


@pytest.fixture()
def repo_copy(small_models: Path, tmp_path: Path) -> Path:
    out = tmp_path / "models"
    shutil.copytree(small_models, out)
    return out


def reseal(root: Path) -> None:
    """Recompute the manifest's checksums after an edit (simulates a consistent-looking but wrong repo)."""
    manifest = read_json(root / MANIFEST)
    for key in ("files", "version", "format"):
        manifest.pop(key)
    write_manifest(root, manifest)


def reseal_edited(root: Path, name: str, edit: Callable[[dict], None]) -> None:
    """``edit`` the JSON artifact ``name`` in place, then ``reseal``: every checksum holds, the pieces disagree."""
    path = root / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    reseal(root)


def test_manifest_lists_every_artifact_with_checksums(small_models: Path) -> None:
    repo = Repository.open(small_models)
    on_disk = {p.relative_to(small_models).as_posix() for p in small_models.rglob("*") if p.is_file()}
    assert set(repo.manifest["files"]) == on_disk - {MANIFEST}
    assert len(repo.version) == 12 and int(repo.version, 16) >= 0
    for name in repo.manifest["files"]:
        assert repo.file(name).exists()


def test_version_depends_only_on_the_artifacts(repo_copy: Path) -> None:
    before = Repository.open(repo_copy).version
    reseal(repo_copy)
    assert Repository.open(repo_copy).version == before
    (repo_copy / "features" / "config.json").write_text(
        (repo_copy / "features" / "config.json").read_text().replace("\n}", ', "note": 1\n}'))
    reseal(repo_copy)
    assert Repository.open(repo_copy).version != before


@pytest.mark.parametrize("name", ["ranking/dlrm.safetensors", "retrieval/index.faiss", "retrieval/two_tower.safetensors"])
def test_corrupt_artifact_is_named(repo_copy: Path, name: str) -> None:
    path = repo_copy / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    load = RankingCore.load if name.startswith("ranking") else RetrievalCore.load
    with pytest.raises(ArtifactMismatch, match=name.split("/")[1]):
        load(repo_copy, device="cpu")


def test_missing_artifact_is_named(repo_copy: Path, small_dataset: Path) -> None:
    (repo_copy / "preprocess" / "vocab_items.parquet").unlink()
    with pytest.raises(ArtifactMismatch, match=r"vocab_items\.parquet"):
        FeatureCore.load(repo_copy, small_dataset)


def test_file_and_check_present_say_the_same_of_a_missing_artifact(tmp_path: Path) -> None:
    """``file`` (hashing, where a stage reads it) and ``check_present`` (sizes, before serve starts) share
    their presence check: a missing artifact, or a directory in its place, is "artifact is missing" from
    both; a truncated one is a size from ``check_present`` and a checksum from ``file``."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(b"weights")
    (tmp_path / "b.json").write_text("{}")
    write_manifest(tmp_path, {"dataset_sha256": "d"})
    Repository.open(tmp_path).check_present()
    (tmp_path / "a" / "w.bin").write_bytes(b"weig")
    with pytest.raises(ArtifactMismatch, match=r"w\.bin: 4 bytes, .*manifest\.json says 7 \(file changed or truncated\)"):
        Repository.open(tmp_path).check_present()
    with pytest.raises(ArtifactMismatch, match=r"w\.bin: sha256 does not match .*manifest\.json"):
        Repository.open(tmp_path).file("a/w.bin")
    shutil.rmtree(tmp_path / "a")
    (tmp_path / "b.json").unlink()
    (tmp_path / "b.json").mkdir()
    for name in ("a/w.bin", "b.json"):
        with pytest.raises(ArtifactMismatch, match=rf"{name.replace('.', '[.]')}: artifact is missing"):
            Repository.open(tmp_path).file(name)
    with pytest.raises(ArtifactMismatch, match=r"w\.bin: artifact is missing"):
        Repository.open(tmp_path).check_present()


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(ArtifactMismatch, match=r"manifest\.json"):
        RankingCore.load(tmp_path, device="cpu")
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactMismatch, match=r"manifest\.json"):
        RetrievalCore.load(tmp_path, device="cpu")


def test_shape_mismatch_between_pieces_is_named(repo_copy: Path) -> None:
    reseal_edited(repo_copy, "ranking/dlrm.json", lambda cfg: cfg.update(item_dense_dim=cfg["item_dense_dim"] + 1))
    with pytest.raises(ArtifactMismatch, match=r"dlrm\.json"):
        RankingCore.load(repo_copy, device="cpu")


def test_weights_not_matching_config_are_named(repo_copy: Path) -> None:
    reseal_edited(repo_copy, "retrieval/two_tower.json", lambda cfg: cfg.update(hidden_dims=[cfg["hidden_dims"][0] + 1]))
    with pytest.raises(ArtifactMismatch, match=r"two_tower\.safetensors"):
        RetrievalCore.load(repo_copy, device="cpu")


def test_index_not_matching_the_items_is_named(repo_copy: Path) -> None:
    reseal_edited(repo_copy, "retrieval/index.json", lambda spec: spec.update(num_items=spec["num_items"] + 1))
    with pytest.raises(ArtifactMismatch, match=r"index\.json"):
        RetrievalCore.load(repo_copy, device="cpu")


def test_a_dataset_given_as_models_and_a_repository_given_as_data_say_so(tmp_path) -> None:
    import json

    from recpipe.datagen.manifest import load_manifest

    data, models = tmp_path / "data", tmp_path / "models"
    data.mkdir()
    models.mkdir()
    (data / "manifest.json").write_text(json.dumps({"schema_version": 1, "sha256": {}, "rows": {}}))
    (models / "manifest.json").write_text(json.dumps({"format": 1, "files": {}, "version": "v"}))
    with pytest.raises(ArtifactMismatch, match=r"data is a dataset \(recpipe synth-data\), not a model repository"):
        Repository.open(data)
    with pytest.raises(ArtifactMismatch, match=r"models is a model repository \(recpipe train --out\), not a dataset"):
        load_manifest(models)


def _files_to_list(m: dict) -> None:
    m["files"] = list(m["files"])


def _entry_to_string(m: dict) -> None:
    m["files"]["ranking/dlrm.json"] = "abc"


def _version_as_object(m: dict) -> None:
    m["version"] = {"v": 1}


def _shape_as_text(m: dict) -> None:
    m["shapes"]["user_dense_dim"] = "x"


@pytest.mark.parametrize("edit", [_files_to_list, _entry_to_string, _version_as_object, _shape_as_text])
def test_an_edited_manifest_is_an_artifact_mismatch_naming_it(repo_copy: Path, edit) -> None:
    # before: AttributeError/TypeError tracebacks from the stage that first asked for a file
    manifest = read_json(repo_copy / MANIFEST)
    edit(manifest)
    (repo_copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactMismatch, match=r"manifest\.json"):
        RankingCore.load(repo_copy, device="cpu")
    with pytest.raises(ArtifactMismatch, match=r"manifest\.json"):
        RetrievalCore.load(repo_copy, device="cpu")


@pytest.mark.parametrize("forge", ["other_columns", "text_values"])
def test_a_forged_vocabulary_is_named(repo_copy: Path, small_dataset: Path, forge: str) -> None:
    # before: polars' ColumnNotFoundError / a ValueError traceback from a resealed repository
    import polars as pl

    path = repo_copy / "preprocess" / "vocab_users.parquet"
    frame = pl.read_parquet(path)
    if forge == "other_columns":
        frame = frame.rename({"column": "name"})
    else:
        frame = frame.with_columns(pl.col("value").cast(pl.String) + "x")
    frame.write_parquet(path)
    reseal(repo_copy)
    with pytest.raises(ArtifactMismatch, match=r"vocab_users\.parquet: vocabulary columns are"):
        FeatureCore.load(repo_copy, small_dataset)


@pytest.mark.parametrize("head", [(2**62).to_bytes(8, "little") + b"{}",
                                  (5).to_bytes(8, "little") + b'"abc"' + bytes(16),
                                  b""], ids=["length_2**62", "header_a_string", "empty"])
def test_a_forged_safetensors_header_is_named(tmp_path: Path, head: bytes) -> None:
    # before: MemoryError (a header length of 2**62 read as is) and AttributeError (a header not an object)
    from recpipe.safetensors_map import map_safetensors

    path = tmp_path / "rows.safetensors"
    path.write_bytes(head)
    with pytest.raises(ArtifactMismatch, match=r"rows\.safetensors: unreadable safetensors"):
        map_safetensors(path)
