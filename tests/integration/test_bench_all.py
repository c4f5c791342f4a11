"""Every ``recpipe bench ...`` subcommand runs end to end at a tiny scale: with ``--device cpu`` here, and
with ``--device cuda`` too where a GPU is present (``bench ranking --device cuda`` once crashed).

A new bench module must add its tiny-scale arguments to ``CASES`` (``test_every_bench_has_a_case``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recpipe.cli import main
from recpipe.commands.bench import _benchmarks

CUDA = torch.cuda.is_available()


def _chain(m: Path, d: Path, tmp: Path, request: pytest.FixtureRequest, device: str) -> list[str]:
    argv = ["--models", str(m), "--data", str(d), "--queries", "5", "--warmup", "1", "--num-candidates", "50",
            "--threads", "1", "--device", device]
    if device == "cpu":  # measure the session's in-process chain; on CUDA the bench starts its own stages
        argv += ["--target", request.getfixturevalue("serving_chain").gateway.address]
    return argv


#: bench name -> (arguments at tiny scale, whether it takes --device)
CASES: dict[str, tuple[Callable[[Path, Path, Path, pytest.FixtureRequest, str], list[str]], bool]] = {
    "chain": (_chain, True),
    "ranking": (lambda m, d, tmp, r, dev: ["--models", str(m), "--data", str(d), "--batch", "50", "--calls", "5",
                                           "--warmup", "1", "--device", dev, "--requests", "3",
                                           "--idle-ms", "1"], True),
    "retrieval": (lambda m, d, tmp, r, dev: ["--models", str(m), "--data", str(d), "--k", "50", "--queries", "5",
                                             "--warmup", "1", "--device", dev], True),
    "features": (lambda m, d, tmp, r, dev: ["--models", str(m), "--data", str(d), "--queries", "5", "--warmup", "1",
                                            "--items", "50"], False),
    "coldstart": (lambda m, d, tmp, r, dev: ["--models", str(m), "--data", str(d), "--stage", "features",
                                             "--repeats", "1"], False),
    "datagen": (lambda m, d, tmp, r, dev: ["--scale", "0.001", "--tmp", str(tmp)], False),
    "preprocess": (lambda m, d, tmp, r, dev: ["--data", str(d), "--max-vocab", "100"], False),
    "querygen": (lambda m, d, tmp, r, dev: ["--rates", "200", "--duration", "0.3", "--warmup", "0.1"], False),
    "hop": (lambda m, d, tmp, r, dev: ["--calls", "20", "--warmup", "5", "--candidates", "50", "--idle-calls", "10",
                                       "--idle-ms", "2"], False),
    "firstcall": (lambda m, d, tmp, r, dev: ["--models", str(m), "--data", str(d), "--precisions", "fp32",
                                             "--counts", "1,50", "--threads", "1", "--out", str(tmp / "fc")], False),
    "overload": (lambda m, d, tmp, r, dev: ["--target", r.getfixturevalue("serving_chain").gateway.address,
                                            "--rate", "10", "--base-s", "0.5", "--overload-s", "0.5",
                                            "--recovery-s", "0.3", "--num-candidates", "50"], False),
}


def test_every_bench_has_a_case() -> None:
    assert set(_benchmarks()) == set(CASES), "add the new bench's tiny-scale arguments to CASES"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")])])
@pytest.mark.parametrize("name", sorted(CASES))
def test_bench_runs(name: str, device: str, small_models: Path, small_dataset: Path, tmp_path: Path,
                    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    make_args, takes_device = CASES[name]
    if device == "cuda" and not takes_device:
        pytest.skip(f"bench {name} does not use a device")
    argv = ["bench", name, *make_args(small_models, small_dataset, tmp_path, request, device)]
    if name == "preprocess" and not os.environ.get("RECPIPE_NVTABULAR_PYTHON"):
        # no NVTabular environment on this machine: the bench says so in one line, exit code 2
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "nvtabular" in err[0].lower()
        return
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.strip()
    if name == "retrieval":
        assert "fp16 exact search + fp32 re-score of top 2k: recall@50 vs fp32 exact" in out
        assert all(f"\n{kind} " in out for kind in ("flat", "ivf", "ivfsq8", "ivfpqfs", "hnsw"))
    if name == "firstcall":  # a real supervised chain: two calls per count, no restart
        assert "--ranking-precision fp32: SERVING after" in out and "restarts in the serve log: 0" in out
        assert (tmp_path / "fc" / "serve-fp32.log").exists() and (tmp_path / "fc" / "firstcall.json").exists()
        assert main(argv) == 2  # its results are not overwritten without --force, before any chain starts
        assert "pass --force" in capsys.readouterr().err
    if name == "hop":  # back to back, then after 2 ms idle before each call
        assert "bare grpc.aio echo after 2 ms idle" in out and "recpipe ranking stage (Rank) after 2 ms idle" in out
        assert "after 2 ms idle the bare echo takes" in out and "(10 calls)" in out
    if name == "ranking":
        assert "served (fused + user-side once)" in out
        # 3 requests as one batch against one by one, in each form (same scores, asserted by the bench)
        assert "3 requests x 50 candidates: one batch against one by one" in out and "batch/one" in out
        # each precision's served forward after 1 ms asleep before each call, against back to back
        assert "the served forward after 1 ms asleep before each call" in out and "\nfp32 " in out
        if device == "cuda":
            assert "served, tables in host memory" in out and "served, no CUDA graphs" in out
        else:  # the eager fp32 forward's item x item triangle beside the full Gram matrix (same scores, asserted)
            assert "served, full item Gram" in out
            if "served bf16 (torch.compile)" in out:  # and the compiled segmented form's, in both tables
                assert "served bf16 (torch.compile), full item Gram" in out and "\nbf16, full item Gram " in out


def test_bench_ranking_says_a_broken_bound_in_its_table_alone(small_models: Path, small_dataset: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The bench loads every precision on purpose and its table says which break the bound; the warning a
    stage logs when the precision asked of it breaks the bound would say it again, as an alarm."""
    from recpipe.ranking import probe

    monkeypatch.setattr(probe, "MAX_ABS_DP", -1.0)  # every precision but fp32 breaks it
    with caplog.at_level(logging.WARNING):
        assert main(["bench", "ranking", "--models", str(small_models), "--data", str(small_dataset), "--batch", "50",
                     "--calls", "3", "--warmup", "1"]) == 0
    assert "BREAKS" in capsys.readouterr().out
    assert not [r.getMessage() for r in caplog.records if "--ranking-precision" in r.getMessage()]
