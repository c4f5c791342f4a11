"""Every command in README.md and docs/*.md works as written, at small scale.

``readme_commands()`` reads the commands out of README.md and the reference pages under docs/ (fenced
``bash`` blocks, indented code blocks and the bench table); ``CASES`` says, for each, how it is run here
at small scale or why it is not. A command added to or changed in those pages without a case here fails
``test_every_readme_command_has_a_case``.

The small-scale runs share one ``recpipe serve`` (a real process tree over the session's tiny model
repository, ``--port 0``): ``127.0.0.1:50051`` and the host-less ``:50052``-``:50054`` in README
commands are replaced by its ports, host-less forms kept host-less; counts and durations shrink
(``--queries 2000`` -> 20, ``--duration 60`` -> 1, ...; each case says how). The flags, paths and
forms are the README's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from locust_stats import final_stats

from recpipe.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: the pages whose commands are run here: the README, then the reference pages it links to
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))

RUN = "run"  # run here at small scale
SKIP = "skip"  # not run here; the reason says where it is covered, or why it cannot be


def readme_commands(text: str | None = None) -> list[str]:
    """The shell commands in README.md and docs/*.md (or in ``text``): lines of fenced ``bash`` blocks
    and 4-space indented blocks (comments dropped; a line starting with ``[`` continues the one above)
    and the bench table's first column."""
    if text is None:
        return [c for page in PAGES for c in readme_commands(page.read_text(encoding="utf-8"))]
    lines = text.splitlines()
    out: list[str] = []
    fenced = False
    for raw in lines:
        if raw.startswith("```"):
            fenced = raw.strip() == "```bash"
            continue
        indented = raw.startswith("    ") and not raw.lstrip().startswith(("-", "*"))
        body = raw.strip()
        if fenced or indented:
            body = re.split(r"\s#\s|\s+#$", body, maxsplit=1)[0].strip()
            if not body or body.startswith("#"):
                continue
            if body.startswith("[") and out:
                out[-1] += " " + body
                continue
            if fenced or re.match(r"^(recpipe|locust|\.ci/|export|docker|python|pip)\b", body):
                out.append(" ".join(body.split()))
        else:
            m = re.match(r"^\| `((?:recpipe|locust) [^`]+)` \|", raw)
            if m:
                out.append(m.group(1))
    return out


def _bracketless(cmd: str) -> str:
    """A synopsis without its optional ``[...]`` parts."""
    return " ".join(re.sub(r"\[[^\]]*\]", " ", cmd).split())


CASES: dict[str, tuple[str, str]] = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && recpipe demo":
        (SKIP, "install steps: this environment is their result; `recpipe demo` runs below"),
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[dev]" && '
    "python -m pytest -q": (SKIP, "the install is this environment, and the test command is this suite"),
    "pip install -e . && pip uninstall -y faiss-cpu && pip install faiss-gpu-cu12":
        (SKIP, "GPU wheel swap: needs a CUDA machine and a package index"),
    "recpipe synth-data --out data --scale 0.1 --seed 0": (RUN, "--scale 0.005"),
    "recpipe train --data data/ --out models/ [--device auto|cpu|cuda] [--epochs N] [--seed N] "
    "[--index auto|flat|ivf|ivfsq8|ivfpqfs|hnsw] [--interaction dot|dcn] [--val-fraction F] [--threads N] "
    "[--preprocess polars|nvtabular] [--force] [--quiet]":
        (RUN, "the session fixture small_models runs `train --data D --out M --epochs 1`; the default "
              "models/ of a fresh clone is test_train_into_the_default_models_dir_of_a_clone"),
    ".ci/nvtabular-env.sh ~/.venvs/recpipe-nvt": (SKIP, "builds the NVTabular venv (4 min, Python 3.11); CI"),
    "export RECPIPE_NVTABULAR_PYTHON=~/.venvs/recpipe-nvt/bin/python": (SKIP, "NVTabular venv; CI"),
    "recpipe train --data data/ --out models/ --preprocess nvtabular":
        (SKIP, "needs the NVTabular venv; tests/nvtabular run it where it exists"),
    "recpipe serve --models models --data data": (RUN, "--port 0"),
    "recpipe serve --models models --data data --replicas ranking=2,gateway=2":
        (RUN, "--port 0 --no-warm-standby: both ranking and both gateway replicas serve; the kill and restart "
              "of a replica is tests/integration/test_replicas.py"),
    "recpipe recommend --user-id 42 [--num-candidates 500] [--num-results 10] [--target 127.0.0.1:50051]":
        (RUN, "gateway port"),
    "recpipe demo [--scale 0.02] [--queries 300] [--workdir demo] [--force]":
        (RUN, "--queries 20, the workdir holding the session's data and models"),
    "recpipe querygen --target 127.0.0.1:50051 --queries 2000 --warmup 5 --out seq.json --plot seq/":
        (RUN, "--queries 20 --warmup 0.2"),
    "recpipe querygen --per-component --features :50052 --retrieval :50053 --ranking :50054 --queries 2000":
        (RUN, "--queries 20, stage ports"),
    "recpipe querygen --target 127.0.0.1:50051 --mode open --rate 200 --duration 60 --warmup 10 --out open.json":
        (RUN, "--rate 20 --duration 1 --warmup 0.2"),
    "recpipe querygen --target 127.0.0.1:50051 --mode closed --concurrency 8 --duration 60":
        (RUN, "--concurrency 2 --duration 1"),
    "recpipe querygen --target 127.0.0.1:50051 --mode open --rate 10 --slo-p99-ms 50 --duration 20 "
    "--out slo.json --plot slo/": (RUN, "--duration 0.5 per step"),
    "recpipe querygen --target 127.0.0.1:50051 --duration 10 --stability-percent 5 --out stable.json":
        (RUN, "--duration 0.3 --stability-percent 50 --max-windows 4"),
    "recpipe querygen --target 127.0.0.1:50051 --mode open --arrivals-file intervals.txt --duration 30":
        (RUN, "--duration 1, an intervals.txt of three intervals"),
    "recpipe querygen --target 127.0.0.1:50051 --mode open --rate 4000 --duration 60 --processes 4 --out open4k.json":
        (RUN, "--rate 40 --duration 1 --processes 2"),
    "recpipe report x86.json gh200.json --labels x86+H100,GH200 --out report/":
        (RUN, "x86.json and gh200.json are two sequential runs"),
    "recpipe characterize --out char-a --data data --models models --threads 1 --quick":
        (RUN, "the session fixture quick_characterization runs it (with --device cpu) once for this test and "
              "tests/integration/test_characterize.py, which checks its sections"),
    "recpipe report char-a char-b --out char-report/": (RUN, "char-b is a copy of char-a"),
    "recpipe bench datagen --scale 1": (RUN, "--scale 0.002"),
    "recpipe bench preprocess --data D": (SKIP, "needs the NVTabular venv (tests/nvtabular)"),
    "recpipe bench features --models M --data D": (RUN, "--queries 3 --warmup 1"),
    "recpipe bench retrieval --models M --data D": (RUN, "--queries 3 --warmup 1"),
    "recpipe bench coldstart --models M --data D": (RUN, "--stage features --repeats 1"),
    "recpipe bench ranking --models M --data D --batch 500": (RUN, "--calls 3 --warmup 1"),
    "recpipe bench chain --models M --data D --threads 1": (RUN, "--queries 5 --warmup 2"),
    "recpipe bench querygen": (RUN, "--rates 100 --duration 0.3 --warmup 0.1"),
    "recpipe bench hop": (RUN, "--calls 20 --warmup 5"),
    "recpipe characterize --out char-a ...":
        (SKIP, "docs/characterize-data-paths.md's outline of the command run in full above (its section is "
               "skipped on a CPU: tests/unit/test_data_paths.py, tests/integration/test_characterize.py)"),
    "recpipe report char-a char-b --out ab/": (SKIP, "the same report of two characterizations as run above"),
    "recpipe bench firstcall --models M --data D --out firstcall/":
        (SKIP, "tests/integration/test_bench_all.py runs it (--precisions fp32 --counts 1,50, its own fresh "
               "supervised chain, and the refusal to overwrite): a second chain here would cost 20 s"),
    "recpipe bench chain --models models --data data --device cuda --queries 500 --nvtx":
        (SKIP, "--nvtx and --device cuda need a CUDA device (its CPU refusal: tests/unit/test_ranking_gpu.py)"),
    "recpipe bench overload --models M --data D --rate R":
        (RUN, "--target (the served chain) --rate 10, phases of 1 s"),
    "recpipe serve --models models --data data &": (RUN, "the same serve as above, in the background"),
    "locust -f loadtest/ --headless -u 8 -r 8 -t 30s --host 127.0.0.1:50051 --csv runs/locust":
        (RUN, "-u 2 -r 2 -t 3s"),
    "locust -f loadtest/ --host 127.0.0.1:50051": (RUN, "web UI on a free port, stopped once it answers"),
    "docker compose up -d --build": (SKIP, "needs a Docker engine (compose files: tests/unit/test_compose.py)"),
    "docker compose -f docker-compose.yml -f docker-compose.cpu.yml up -d --build": (SKIP, "Docker engine"),
    'RECPIPE_SCALE=0.05 RECPIPE_TRAIN_ARGS="--epochs 1" docker compose up -d --build': (SKIP, "Docker engine"),
    "docker compose --profile loadtest up -d locust": (SKIP, "Docker engine"),
    "docker compose down -v": (SKIP, "Docker engine"),
    "docker compose up -d --scale ranking=3 --scale features=2": (SKIP, "Docker engine"),
    "RECPIPE_RANKING_REPLICAS=3 RECPIPE_FEATURES_REPLICAS=2 docker compose up -d":
        (SKIP, "Docker engine; tests/unit/test_compose.py resolves the replicas these settings give"),
    "bash .ci/base-image.sh": (SKIP, "Docker engine; .ci/compose-smoke.sh runs it"),
    "docker build -t recpipe:cpu --network host --build-arg VARIANT=cpu --build-arg "
    "PYTHON_IMAGE=recpipe-python:3.11-bookworm --build-arg TORCH_INDEX_URL=http://127.0.0.1:8000/simple .":
        (SKIP, "Docker engine; .ci/compose-smoke.sh runs this build with its own index port"),
    "RECPIPE_VARIANT=cpu docker compose -f docker-compose.yml -f docker-compose.cpu.yml -f "
    "docker-compose.hostnet.yml up -d": (SKIP, "Docker engine; .ci/compose-smoke.sh runs it"),
    "docker build -t recpipe:0.1.0-cpu --build-arg VARIANT=cpu .": (SKIP, "Docker engine and an image registry"),
    "kubectl kustomize deploy/k8s/overlays/cpu":
        (SKIP, "tests/unit/test_k8s_manifests.py and .ci/k8s-validate.sh run it for every overlay"),
    "kubectl apply -k deploy/k8s/overlays/cpu": (SKIP, "needs a cluster; none here"),
    "kubectl -n recpipe wait --for=condition=complete job/recpipe-init --timeout=30m": (SKIP, "needs a cluster"),
    "kubectl -n recpipe rollout status deployment/gateway --timeout=10m": (SKIP, "needs a cluster"),
    "kubectl -n recpipe port-forward service/recpipe-gateway 50051:50051": (SKIP, "needs a cluster"),
    "kubectl -n recpipe scale deployment/ranking --replicas=3": (SKIP, "needs a cluster"),
}

def test_every_readme_command_has_a_case() -> None:
    found = readme_commands()
    assert len(found) >= 30, found
    missing = [c for c in found if c not in CASES]
    stale = [c for c in CASES if c not in found]
    assert not missing, f"README/docs commands without a case in {__file__}: {missing}"
    assert not stale, f"cases for commands no longer in README.md or docs/: {stale}"


def test_the_pages_are_the_readme_and_the_reference() -> None:
    # the README keeps the two quick-start commands; the reference pages hold the rest
    names = [p.relative_to(ROOT).as_posix() for p in PAGES]
    assert names[0] == "README.md" and "docs/serving.md" in names and "docs/measuring.md" in names
    quick = readme_commands(README.read_text(encoding="utf-8"))
    assert any(c.endswith("&& recpipe demo") for c in quick) and any(c.endswith("python -m pytest -q") for c in quick)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _argv(cmd: str, ports: dict[str, int], **small: str) -> list[str]:
    """The README command's arguments after ``recpipe``: targets on this test's ports, host-less
    forms kept host-less, and ``small`` replacing the value of each named flag."""
    cmd = _bracketless(cmd)
    cmd = cmd.replace("127.0.0.1:50051", f"127.0.0.1:{ports['gateway']}")
    for name, default in (("features", 50052), ("retrieval", 50053), ("ranking", 50054)):
        cmd = cmd.replace(f":{default}", f":{ports[name]}")
    words = shlex.split(cmd)
    assert words[0] == "recpipe", cmd
    words = words[1:]
    for flag, value in small.items():
        flag = "--" + flag.replace("_", "-")
        if flag in words:
            words[words.index(flag) + 1] = value
        else:
            words += [flag, value]
    return words


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory, small_dataset: Path, small_models: Path) -> Path:
    """A working directory laid out like a clone after synth-data and train: data/, models/ and the
    loadtest/ directory."""
    d = tmp_path_factory.mktemp("readme")
    (d / "data").symlink_to(small_dataset, target_is_directory=True)
    (d / "models").symlink_to(small_models, target_is_directory=True)
    (d / "loadtest").symlink_to(ROOT / "loadtest", target_is_directory=True)
    return d


@pytest.fixture(scope="module")
def served(clone: Path) -> Iterator[tuple[dict[str, int], subprocess.Popen[str]]]:
    """README: ``recpipe serve --models models --data data`` (``--port 0``), in the clone."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "recpipe", "serve", "--models", "models", "--data", "data", "--port", "0"],
        cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    ports: dict[str, int] = {}
    lines: list[str] = []
    deadline = time.monotonic() + 180
    try:
        while len(ports) < 4 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            words = line.split()
            if words and words[0] in ("gateway", "features", "retrieval", "ranking") and ":" in words[1]:
                ports[words[0]] = int(words[1].rsplit(":", 1)[1])
        assert len(ports) == 4, "".join(lines)
        text = "".join(lines)
        assert "recpipe-stage-ready" not in text  # the stages' handshakes stay off stdout
        machine = next(line for line in lines if line.startswith("machine: "))
        assert re.search(r"\d+ cores, GPU .+ \| features cpu .+, retrieval cpu .+, ranking cpu .+, gateway cpu",
                         machine), machine
        yield ports, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ok(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0, (argv, captured.err[-2000:])
    return captured.out


def _locust_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RECPIPE_", "LOCUST_"))}


def test_every_readme_command_works_at_small_scale(
    clone: Path, served: tuple[dict[str, int], subprocess.Popen[str]], small_models: Path, small_dataset: Path,
    quick_characterization: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    ports, _ = served
    monkeypatch.chdir(clone)
    done: set[str] = set()

    def case(cmd: str) -> str:
        assert CASES[cmd][0] == RUN, cmd
        done.add(cmd)
        return cmd

    # --- synth-data: its summary reaches stdout even when stdout is not a terminal ---
    cmd = case("recpipe synth-data --out data --scale 0.1 --seed 0")
    out = _ok(_argv(cmd.replace("--out data", "--out fresh-data"), ports, scale="0.005"), capsys)
    assert out.startswith("wrote fresh-data: ") and "oracle AUC 0." in out
    # --- train: the session's small_models fixture ran it (into a fresh directory) ---
    done.add(case(next(c for c in CASES if c.startswith("recpipe train --data data/ --out models/ [--device"))))
    assert (small_models / "manifest.json").exists()
    # --- serve (the fixture) and recommend ---
    done.add(case("recpipe serve --models models --data data"))
    done.add(case("recpipe serve --models models --data data &"))
    cmd = case("recpipe recommend --user-id 42 [--num-candidates 500] [--num-results 10] [--target 127.0.0.1:50051]")
    out = _ok(_argv(cmd, ports, target=f"127.0.0.1:{ports['gateway']}"), capsys)
    assert "rank" in out
    # --- querygen, every README form ---
    out = _ok(_argv(case("recpipe querygen --target 127.0.0.1:50051 --queries 2000 --warmup 5 --out seq.json "
                         "--plot seq/"), ports, queries="20", warmup="0.2"), capsys)
    assert out.splitlines()[1].startswith("machine: ") and "end to end" in out
    assert sorted(p.name for p in Path("seq").iterdir()) == ["latency_cdf.png", "stage_latency.png"]
    out = _ok(_argv(case("recpipe querygen --per-component --features :50052 --retrieval :50053 --ranking :50054 "
                         "--queries 2000"), ports, queries="20"), capsys)
    assert "per component" in out
    _ok(_argv(case("recpipe querygen --target 127.0.0.1:50051 --mode open --rate 200 --duration 60 --warmup 10 "
                   "--out open.json"), ports, rate="20", duration="1", warmup="0.2"), capsys)
    assert json.loads(Path("open.json").read_text())["send_lag"]["count"] > 0
    _ok(_argv(case("recpipe querygen --target 127.0.0.1:50051 --mode closed --concurrency 8 --duration 60"), ports,
              concurrency="2", duration="1"), capsys)
    _ok(_argv(case("recpipe querygen --target 127.0.0.1:50051 --mode open --rate 10 --slo-p99-ms 50 --duration 20 "
                   "--out slo.json --plot slo/"), ports, duration="0.5"), capsys)
    assert json.loads(Path("slo.json").read_text())["slo"]["curve"] and Path("slo/slo_curve.png").exists()
    _ok(_argv(case("recpipe querygen --target 127.0.0.1:50051 --duration 10 --stability-percent 5 --out stable.json"),
              ports, duration="0.3", stability_percent="50", max_windows="4"), capsys)
    assert len(json.loads(Path("stable.json").read_text())["stability"]["windows"]) >= 3
    Path("intervals.txt").write_text("# microseconds\n50000\n100000\n150000\n")
    _ok(_argv(case("recpipe querygen --target 127.0.0.1:50051 --mode open --arrivals-file intervals.txt "
                   "--duration 30"), ports, duration="1"), capsys)
    _ok(_argv(case("recpipe querygen --target 127.0.0.1:50051 --mode open --rate 4000 --duration 60 --processes 4 "
                   "--out open4k.json"), ports, rate="40", duration="1", processes="2"), capsys)
    run = json.loads(Path("open4k.json").read_text())
    assert run["queries"] == 40 and [s["queries"] for s in run["generator"]["senders"]] == [20, 20]
    # --- report: two runs measured the same way ---
    shutil.copy("seq.json", "x86.json")
    _ok(["querygen", "--target", f"127.0.0.1:{ports['gateway']}", "--queries", "20", "--out", "gh200.json",
         "--quiet"], capsys)
    out = _ok(_argv(case("recpipe report x86.json gh200.json --labels x86+H100,GH200 --out report/"), ports), capsys)
    assert "GH200" in out and sorted(p.name for p in Path("report").iterdir()) == [
        "comparison.png", "latency_cdf.png", "report.md", "stages.png"]
    # --- characterize (the session's quick_characterization ran it), and report on two characterizations ---
    done.add(case("recpipe characterize --out char-a --data data --models models --threads 1 --quick"))
    shutil.copytree(quick_characterization.out, "char-a")
    assert quick_characterization.stdout.startswith("characterization: ")
    assert (Path("char-a") / "report" / "curve.png").exists()
    shutil.copytree("char-a", "char-b")
    out = _ok(_argv(case("recpipe report char-a char-b --out char-report/"), ports), capsys)
    assert "## Sequential per-stage latency" in out and Path("char-report/curves.png").exists()
    # --- bench ---
    m, d = str(small_models), str(small_dataset)
    for cmd, small in (
        ("recpipe bench datagen --scale 1", {"scale": "0.002"}),
        ("recpipe bench features --models M --data D", {"queries": "3", "warmup": "1"}),
        ("recpipe bench retrieval --models M --data D", {"queries": "3", "warmup": "1"}),
        ("recpipe bench coldstart --models M --data D", {"stage": "features", "repeats": "1"}),
        ("recpipe bench ranking --models M --data D --batch 500", {"calls": "3", "warmup": "1"}),
        ("recpipe bench chain --models M --data D --threads 1", {"queries": "5", "warmup": "2"}),
        ("recpipe bench querygen", {"rates": "100", "duration": "0.3", "warmup": "0.1"}),
        ("recpipe bench hop", {"calls": "20", "warmup": "5"}),
        ("recpipe bench overload --models M --data D --rate R",
         {"target": f"127.0.0.1:{ports['gateway']}", "rate": "10", "base_s": "1", "overload_s": "1",
          "recovery_s": "0.5"}),
    ):
        argv = _argv(case(cmd).replace(" M ", f" {m} ").replace(" D", f" {d}"), ports, **small)
        _ok(argv, capsys)
    # --- locust: headless (stage rows in µs, the Aggregated row not inflated), then the web UI ---
    cmd = case("locust -f loadtest/ --headless -u 8 -r 8 -t 30s --host 127.0.0.1:50051 --csv runs/locust")
    argv = shlex.split(cmd.replace("127.0.0.1:50051", f"127.0.0.1:{ports['gateway']}")
                       .replace("-u 8 -r 8 -t 30s", "-u 2 -r 2 -t 3s"))
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=clone, env=_locust_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (clone / "runs" / "locust_stats.csv").exists()
    # The final summary (the CSV is rewritten about once a second and may trail the run: locust_stats.py)
    rows = {name: (r["Type"], int(r["Request Count"])) for name, r in final_stats(proc.stderr).items()}
    assert "stage:rank" in rows, proc.stderr[-4000:]
    assert rows["stage:rank"][0] == "stage_us" and rows["stage:rank"][1] == rows["Recommend"][1] > 0
    assert rows["Aggregated"][1] == rows["Recommend"][1]  # stage rows do not inflate it
    cmd = case("locust -f loadtest/ --host 127.0.0.1:50051")
    web = _free_port()
    argv = shlex.split(cmd.replace("127.0.0.1:50051", f"127.0.0.1:{ports['gateway']}"))
    ui = subprocess.Popen([sys.executable, "-m", *argv, "--web-host", "127.0.0.1", "--web-port", str(web)],
                          cwd=clone, env=_locust_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        status = 0
        while time.monotonic() < deadline and not status:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web}/", timeout=2) as r:
                    status = r.status
            except OSError:
                time.sleep(0.3)
        assert status == 200
    finally:
        ui.terminate()
        ui.wait(30)
    # --- serve with replicas: two ranking and two gateway processes (test_replicas.py kills one) ---
    cmd = case("recpipe serve --models models --data data --replicas ranking=2,gateway=2")
    _serve_replicas([*_argv(cmd, ports, port="0", metrics_port="0"), "--no-warm-standby"], clone)
    # --- demo: reuses a workdir holding data/ and models/ ---
    demo = clone / "demo"
    demo.mkdir()
    (demo / "data").symlink_to(small_dataset, target_is_directory=True)
    (demo / "models").symlink_to(small_models, target_is_directory=True)
    argv = _argv(case("recpipe demo [--scale 0.02] [--queries 300] [--workdir demo] [--force]"), ports,
                 queries="20", workdir="demo")
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    out, err = captured.out, captured.err
    assert "reusing" in err and "reusing" not in out and "recpipe-stage-ready" not in out
    lines = out.splitlines()
    assert lines[0].startswith("recpipe querygen: mode sequential") and "20 queries" in lines[0]
    assert lines[1].startswith("machine: ") and "ranking cpu" in lines[1]
    runs = sorted(demo.glob("run-*.json"))
    assert len(runs) == 1 and json.loads(runs[0].read_text())["queries"] == 20
    assert sorted(p.name for p in demo.glob("charts-*/*.png")) == ["latency_cdf.png", "stage_latency.png"]
    assert "next, try:" in out and f"recpipe report {Path('demo') / runs[0].name} seq.json" in out

    assert done == {c for c, (how, _) in CASES.items() if how == RUN}


def test_the_demos_next_steps_paste_into_a_shell_as_they_read(tmp_path: Path) -> None:
    """The demo's "next, try" lines are meant to be pasted: a workdir (or checkout) whose path holds a
    space or a quote stays one word in each, and every line is a README command with the demo's paths."""
    from recpipe.commands.demo import next_steps
    from recpipe.querygen.slo import SloSearch

    workdir = tmp_path / "my demo's dir"
    run_json = workdir / "run-20260101T000000Z.json"
    text = next_steps(workdir, run_json)
    lines = text.splitlines()
    assert lines[0] == "next, try:"
    words = [shlex.split(line, comments=True) for line in lines[1:]]
    assert words[0][:5] == ["recpipe", "serve", "--models", str(workdir / "models"), "--data"]
    assert words[0][5:] == [str(workdir / "data"), "&"]
    assert words[2][:4] == ["recpipe", "report", str(run_json), "seq.json"]
    assert words[4][:3] == ["locust", "-f", str(ROOT / "loadtest")]
    # the two querygen lines are docs/measuring.md's commands, run above; the SLO search says how long it takes
    assert CASES[" ".join(words[1])][0] == RUN and CASES[" ".join(words[3])][0] == RUN
    assert f"# up to {SloSearch.max_steps} steps of 20 s each" in lines[4]


def test_the_demos_next_serve_runs_the_chain_the_demo_measured(tmp_path: Path) -> None:
    """The serving flags given to the demo are on its suggested `recpipe serve`, as serve takes them, so the
    suggested querygen run and `recpipe report` compare the same chain; the defaults add nothing."""
    from recpipe.cli import build_parser
    from recpipe.commands.demo import next_steps, serving_flags

    parser = build_parser()
    plain = parser.parse_args(["demo"])
    assert serving_flags(plain) == ""
    args = parser.parse_args(["demo", "--threads", "2", "--replicas", "ranking=2", "--affinity", "off",
                              "--device", "cpu"])
    line = next_steps(tmp_path, tmp_path / "run.json", "", serving_flags(args)).splitlines()[1]
    serve = shlex.split(line, comments=True)[:-1]  # without the trailing &
    assert serve[6:] == ["--device", "cpu", "--threads", "2", "--replicas", "ranking=2", "--affinity", "off"]
    served = parser.parse_args(serve[1:])  # serve takes each as the demo did
    assert (served.device, served.threads, served.replicas, served.affinity) == ("cpu", 2, "ranking=2", "off")


def _serve_replicas(argv: list[str], cwd: Path) -> None:
    """``recpipe serve --replicas ranking=2,gateway=2`` in the clone: its summary lists both replicas of
    each, and Recommend calls over several connections to the one gateway address reach both gateway
    replicas, whose Rank calls reach both ranking replicas."""
    from test_replicas import recommend_from_new_clients, serving, until_each_takes_calls

    here = os.getcwd()
    os.chdir(cwd)  # models/ and data/ as the command names them
    try:
        with serving(argv, 6) as s:
            assert [n for n in s.rows if "#" in n] == ["ranking#1", "ranking#2", "gateway#1", "gateway#2"]
            gateways = [s.rows[f"gateway#{k}"]["metrics"] for k in (1, 2)]
            served = recommend_from_new_clients(s.targets["gateway"], gateways)
            assert sum(served) == 16 and min(served) > 0, served
            ranked = until_each_takes_calls(s.targets["gateway"], [s.rows[f"ranking#{k}"]["metrics"] for k in (1, 2)],
                                            "RankingService/Rank")
            assert min(ranked) > 0, ranked
    finally:
        os.chdir(here)


def test_train_into_the_default_models_dir_of_a_clone(tmp_path: Path, small_dataset: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # A fresh clone: models/ holds exactly what git tracks there.
    tracked = subprocess.run(["git", "ls-files", "models"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for rel in tracked:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    (tmp_path / "data").symlink_to(small_dataset, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--data", "data/", "--out", "models/", "--epochs", "1", "--quiet"]) == 0
