"""A training run's process-wide settings are its own: TF32 and the thread counts come back when it
returns or raises (recpipe/training/process_settings.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import faiss
import pytest
import torch

from recpipe.cli import main
from recpipe.repository import Repository
from recpipe.training import loops, process_settings

#: torch's per-backend float32 precisions (torch >= 2.4), parents first: the order they are put back in
FP32_PRECISIONS = ("", "cuda", "cudnn", "mkldnn", "cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul",
                   "mkldnn.conv", "mkldnn.rnn")


def _backend(path: str) -> Any:
    owner: Any = torch.backends
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part, None)
    return owner


def _read(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except RuntimeError:  # torch's legacy getters refuse a state set through the newer API
        return "refused"


def settings() -> dict[str, Any]:
    """What a training run may change, read through every API torch has for it."""
    state = {
        "cuda.matmul.allow_tf32": _read(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn.allow_tf32": _read(lambda: torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
        "torch_threads": torch.get_num_threads(),
        "faiss_threads": faiss.omp_get_max_threads(),
    }
    for path in FP32_PRECISIONS:
        state[f"{path or 'generic'}.fp32_precision"] = getattr(_backend(path), "fp32_precision", None)
    return state


@pytest.fixture
def restored() -> Iterator[dict[str, Any]]:
    """The session's settings, put back after the test whatever it did (the settings under test included)."""
    before = settings()
    yield before
    torch.set_num_threads(before["torch_threads"])
    faiss.omp_set_num_threads(before["faiss_threads"])
    if before["float32_matmul_precision"] != "refused":
        torch.set_float32_matmul_precision(before["float32_matmul_precision"])
    for path in FP32_PRECISIONS:  # after the legacy setter, which writes some of them
        if before[f"{path or 'generic'}.fp32_precision"] is not None:
            _backend(path).fp32_precision = before[f"{path or 'generic'}.fp32_precision"]
    assert settings() == before


def _start(state: str) -> None:
    """A caller's TF32 setting: through the legacy API, or through the per-backend one alone."""
    if state in ("highest", "high", "medium"):
        torch.set_float32_matmul_precision(state)
    elif state == "ieee, per backend":
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    elif state == "tf32 and bf16, per backend":  # a state the legacy getters refuse to read
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"


STARTS = ["as the session has it", "highest", "high", "medium", "ieee, per backend", "tf32 and bf16, per backend"]


@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize("raises", [False, True])
def test_tf32_is_on_inside_the_block_and_as_it_was_after(start: str, raises: bool,
                                                           restored: dict[str, Any]) -> None:
    if start.endswith("per backend") and not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch < 2.4 has no per-backend precision")
    _start(start)
    before = settings()
    with pytest.raises(RuntimeError, match="inside") if raises else contextlib.nullcontext(), \
            process_settings.tf32_matmuls():
        inside = settings()
        if inside["cuda.matmul.fp32_precision"] is not None:
            assert inside["cuda.matmul.fp32_precision"] == "tf32"
        # on, and readable wherever it was readable before: the two records never disagree
        assert inside["cuda.matmul.allow_tf32"] in (True, "refused")
        assert [k for k, v in inside.items() if v == "refused"] == [k for k, v in before.items() if v == "refused"]
        if before["float32_matmul_precision"] == "medium":
            assert inside["float32_matmul_precision"] == "medium"  # not lowered to "high"
        if raises:
            raise RuntimeError("inside")
    assert settings() == before


def test_tf32_left_off_changes_nothing(restored: dict[str, Any]) -> None:
    with process_settings.tf32_matmuls(enabled=False):
        assert settings() == restored
    assert settings() == restored


@pytest.mark.parametrize("raises", [False, True])
def test_a_training_runs_settings_come_back_also_when_it_raises(raises: bool, restored: dict[str, Any]) -> None:
    torch.set_num_threads(3)
    before = settings()
    with pytest.raises(RuntimeError, match="inside") if raises else contextlib.nullcontext(), \
            process_settings.training_settings(threads=1, tf32=True):
        assert torch.get_num_threads() == 1 and torch.backends.cuda.matmul.allow_tf32 is True
        if raises:
            raise RuntimeError("inside")
    assert settings() == before and before["torch_threads"] == 3


def test_recpipe_train_leaves_the_process_as_it_found_it(small_dataset: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         restored: dict[str, Any]) -> None:
    """On the CPU here; on CUDA the same scope holds TF32 (the tests above set it on a CPU-only build)."""
    torch.set_num_threads(3)  # not what the run asks for
    before = settings()
    out = tmp_path / "models"
    assert main(["train", "--data", str(small_dataset), "--out", str(out), "--epochs", "1", "--threads", "2",
                 "--index", "flat", "--quiet"]) == 0  # flat: auto's pick here, without timing the others
    assert Repository.open(out).manifest["training"]["torch_threads"] == 2  # the run's own count
    assert settings() == before
    # and when it fails half-way: its data read and preprocessed, its settings in force, its first model
    # training (the rest of a run is the same scope: the run above came back from all of it)
    ran: list[int] = []

    def fail(*args: Any, **kwargs: Any) -> Any:
        ran.append(torch.get_num_threads())
        raise RuntimeError("training failed")

    monkeypatch.setattr(loops, "train_two_tower", fail)
    with pytest.raises(RuntimeError, match="training failed"):
        main(["train", "--data", str(small_dataset), "--out", str(tmp_path / "again"), "--epochs", "1",
              "--threads", "1", "--quiet"])
    assert ran == [1] and settings() == before


def test_a_cuda_run_multiplies_in_tf32_and_its_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        restored: dict[str, Any]) -> None:
    """The run's body sees its own settings; no GPU needed: the device is faked and the body stops there."""
    from recpipe.training import pipeline
    from recpipe.training.config import TrainConfig

    seen: dict[str, Any] = {}

    def body(*args: Any) -> Any:
        seen.update(settings(), device=args[3].type)
        raise RuntimeError("stopped")

    monkeypatch.setattr(pipeline.devices, "resolve", lambda name: torch.device("cuda"))
    monkeypatch.setattr(pipeline, "_train", body)
    with pytest.raises(RuntimeError, match="stopped"):
        pipeline.train(tmp_path, tmp_path / "models", TrainConfig(threads=3))
    assert seen["device"] == "cuda" and seen["cuda.matmul.allow_tf32"] is True and seen["torch_threads"] == 3
    assert settings() == restored
