"""The benches refuse bad input up front, before any model loads, server starts or file is written: one line
naming the flag and its value, exit code 2; an existing --out is replaced only with --force."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import one_line_exit_2


def _dirs(tmp_path: Path) -> list[str]:
    """--models/--data that exist (the checks under test come before anything reads them)."""
    for name in ("m", "d"):
        (tmp_path / name).mkdir(exist_ok=True)
    return ["--models", str(tmp_path / "m"), "--data", str(tmp_path / "d")]


#: the benches that write --out FILE
OUT_BENCHES = ("chain", "overload", "preprocess")


def _out_argv(bench: str, tmp_path: Path) -> list[str]:
    """``bench``'s arguments but --out (a --target that is never reached: the checks come first)."""
    dirs = _dirs(tmp_path)
    return {"chain": [*dirs, "--queries", "5"], "overload": ["--target", "127.0.0.1:1", "--rate", "5"],
            "preprocess": dirs[2:]}[bench]


@pytest.mark.parametrize("bench", OUT_BENCHES)
def test_an_existing_out_file_is_kept_without_force(bench: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    victim = tmp_path / "victim.json"
    victim.write_text("precious\n")
    argv = ["bench", bench, *_out_argv(bench, tmp_path), "--out", str(victim)]
    assert one_line_exit_2(capsys, argv) == f"recpipe: error: --out: {victim} exists; pass --force to overwrite it"
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("bench", OUT_BENCHES)
def test_an_out_file_that_cannot_be_written_is_refused_before_the_run(bench: str, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", bench, *_out_argv(bench, tmp_path), "--out", "/proc/x/y.json", "--force"]
    assert one_line_exit_2(capsys, argv) == "recpipe: error: --out: directory /proc/x does not exist"
    argv[-2] = str(tmp_path)  # a directory
    assert one_line_exit_2(capsys, argv) == f"recpipe: error: --out: {tmp_path} is a directory; give a file name"


def test_firstcall_refuses_an_out_that_is_no_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    base = ["bench", "firstcall", *_dirs(tmp_path), "--precisions", "fp32", "--out"]
    assert one_line_exit_2(capsys, [*base, str(afile)]) == f"recpipe: error: --out {afile} is not a directory"
    assert afile.read_text() == "mine\n"
    assert one_line_exit_2(capsys, [*base, "/proc/x"]).startswith("recpipe: error: --out /proc/x: cannot create it")
    out = tmp_path / "fc"
    out.mkdir()
    (out / "firstcall.json").write_text("earlier\n")
    assert one_line_exit_2(capsys, [*base, str(out)]).endswith("firstcall.json exists; pass --force to overwrite it")
    assert (out / "firstcall.json").read_text() == "earlier\n" and not (out / "serve-fp32.log").exists()


@pytest.mark.parametrize("flags, message", [
    (["--counts", "99999"], "--counts must be in 1..10000, got 99999"),
    (["--counts", "1,0"], "--counts must be in 1..10000, got 0"),
    (["--timeout", "nan"], "--timeout must be a finite number > 0, got nan"),
    (["--timeout", "-1"], "--timeout must be a finite number > 0, got -1.0"),
    (["--threads", "-1"], "--threads must be auto or a number >= 0, got '-1'"),
    (["--precisions", "fp32,fp8"], "--precisions takes forms of auto|fp32|bf16|int8, comma-separated, got 'fp32,fp8'"),
])
def test_firstcall_refuses_bad_flags_before_any_chain(flags: list[str], message: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fc"
    assert one_line_exit_2(capsys, ["bench", "firstcall", *_dirs(tmp_path), "--out", str(out), *flags]) == \
        f"recpipe: error: {message}"
    assert not out.exists()


def test_datagen_refuses_a_tmp_it_cannot_write_in(capsys: pytest.CaptureFixture[str]) -> None:
    assert one_line_exit_2(capsys, ["bench", "datagen", "--tmp", "/proc", "--scale", "0.001"]).startswith(
        "recpipe: error: --tmp: cannot write in /proc")


@pytest.mark.parametrize("bench, flags, message", [
    ("ranking", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("ranking", ["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    ("ranking", ["--calls", "0"], "--calls must be >= 1, got 0"),
    ("ranking", ["--requests", "0"], "--requests must be >= 1, got 0"),
    ("ranking", ["--batch", "10001"], "--batch must be in 1..10000, got 10001"),
    ("ranking", ["--threads", "-2"], "--threads must be >= 0, got -2"),
    ("features", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("features", ["--items", "0"], "--items must be >= 1, got 0"),
    ("chain", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("chain", ["--num-candidates", "20000"], "--num-candidates must be in 1..10000, got 20000"),
    ("chain", ["--num-candidates", "50", "--num-results", "60"], "--num-results must be in 1..50, got 60"),
    ("retrieval", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("retrieval", ["--k", "99999999"], "--k must be in 1..10000, got 99999999"),
    ("retrieval", ["--k", "100,0"], "--k must be in 1..10000, got 0"),
    ("retrieval", ["--tune-queries", "0"], "--tune-queries must be >= 1, got 0"),
    ("hop", ["--workers", "-1"], "--workers must be >= 0, got -1"),
    ("hop", ["--candidates", "10001"], "--candidates must be in 1..10000, got 10001"),
    ("hop", ["--idle-calls", "3"], "--idle-calls must be 0 or >= 10, got 3"),
    ("coldstart", ["--timeout", "nan"], "--timeout must be a finite number > 0, got nan"),
    ("coldstart", ["--poll-ms", "0"], "--poll-ms must be a finite number > 0, got 0.0"),
    ("overload", ["--rate", "5", "--timeout", "nan"], "--timeout must be a finite number > 0, got nan"),
    ("overload", ["--rate", "inf"], "--rate must be a finite number > 0, got inf"),
    ("overload", ["--rate", "5", "--factor", "0.5"], "--factor must be a finite number >= 1, got 0.5"),
    ("overload", ["--rate", "5", "--seed", "-1"], "--seed must be >= 0, got -1"),
    ("overload", ["--rate", "5", "--max-queue", "0"], "--max-queue must be >= 1, got 0"),
    ("overload", ["--rate", "5", "--sustained", "nan"], "--sustained must be a finite number > 0, got nan"),
])
def test_each_bad_value_is_named_with_its_flag(bench: str, flags: list[str], message: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    dirs = [] if bench == "hop" else _dirs(tmp_path)
    assert one_line_exit_2(capsys, ["bench", bench, *dirs, *flags]) == f"recpipe: error: {message}"


def test_retrieval_refuses_a_k_over_the_index_size(small_models: Path, small_dataset: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from recpipe.repository import Repository

    items = Repository.open(small_models).section("shapes")["num_items"]
    assert items < 10_000
    argv = ["bench", "retrieval", "--models", str(small_models), "--data", str(small_dataset), "--k", f"100,{items + 1}"]
    assert one_line_exit_2(capsys, argv) == f"recpipe: error: --k must be at most the index's {items} items, got {items + 1}"
