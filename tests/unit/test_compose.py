"""docker-compose.yml and its overrides: valid for Compose v2, and wired the way the deployment needs.

The checks resolve the files with `docker compose config` (Compose v2, which validates and merges
compose files without a Docker engine and reads the CPU override's `!reset`); they are skipped where
it is not installed (.ci/run installs it with .ci/compose-v2.sh). `.ci/compose-smoke.sh` builds the
image and brings the stack up for real.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = shutil.which("docker")


def _compose_v2() -> bool:
    if DOCKER is None:
        return False
    out = subprocess.run([DOCKER, "compose", "version", "--short"], capture_output=True, text=True, timeout=60)
    return out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2.")


pytestmark = pytest.mark.skipif(not _compose_v2(), reason="Docker Compose v2 (docker compose) not installed")

STAGE_PORTS = {"gateway": 50051, "features": 50052, "retrieval": 50053, "ranking": 50054}
SCALABLE = ("features", "retrieval", "ranking")
GPU_SERVICES = ("init", "retrieval", "ranking")  # init trains on the GPU where there is one
CPU = ("docker-compose.yml", "docker-compose.cpu.yml")
HOSTNET = (*CPU, "docker-compose.hostnet.yml")


def compose(*args: str, files: tuple[str, ...] = ("docker-compose.yml",), cwd: Path = ROOT,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert DOCKER is not None
    flags = [arg for f in files for arg in ("-f", f)]
    return subprocess.run([DOCKER, "compose", "-p", "recpipe-test", *flags, "--profile", "loadtest", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RECPIPE_VARIANT": "", **(env or {})})


def resolve(*files: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose files as Compose v2 merges them (anchors, overrides, variables at their defaults)."""
    out = compose("config", "--format", "json", files=files, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    return resolve("docker-compose.yml")


@pytest.fixture(scope="module")
def hostnet() -> dict[str, Any]:
    return resolve(*HOSTNET, env={"RECPIPE_VARIANT": "cpu"})


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def _gpu_devices(svc: dict[str, Any]) -> list[dict[str, Any]]:
    return svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", []) or []


@pytest.mark.parametrize("files", [("docker-compose.yml",), CPU, HOSTNET], ids=["base", "cpu", "hostnet"])
def test_compose_files_are_valid(files: tuple[str, ...]) -> None:
    out = compose("config", "-q", files=files)
    assert out.returncode == 0, out.stderr


def test_invalid_compose_file_is_rejected(tmp_path: Path) -> None:
    # the validation above can fail: a misspelt depends_on condition is refused
    broken = (ROOT / "docker-compose.yml").read_text().replace(
        "service_completed_successfully", "service_completed_sucessfully", 1)
    (tmp_path / "docker-compose.yml").write_text(broken)
    out = compose("config", "-q", cwd=tmp_path)
    assert out.returncode != 0


def test_stages_wait_for_init_and_check_health_on_their_own_port(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert services["init"].get("restart", "no") == "no"
    for name, port in STAGE_PORTS.items():
        svc = services[name]
        assert svc["depends_on"]["init"]["condition"] == "service_completed_successfully", name
        command = svc["command"]
        assert command[:4] == ["recpipe", "serve", "--stage", name], command
        assert _flag(command, "--port") == str(port)
        # every interface of the container, from the environment (`--host` would override it)
        assert "--host" not in command and svc["environment"]["RECPIPE_BIND_HOST"] == "0.0.0.0", name
        test = svc["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "recpipe.serving.healthcheck"] and test[4] == f"127.0.0.1:{port}", test
    for name in SCALABLE:
        assert services["gateway"]["depends_on"][name]["condition"] == "service_healthy"


def test_gateway_reaches_stages_by_dns_so_replicas_share_load(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    gateway = services["gateway"]
    for name in SCALABLE:
        assert _flag(gateway["command"], f"--{name}") is None  # the environment says where
        assert gateway["environment"][f"RECPIPE_{name.upper()}_TARGET"] == f"dns:///{name}:{STAGE_PORTS[name]}"
    for name in SCALABLE:  # `--scale NAME=3` needs no fixed name and no host port
        assert "container_name" not in services[name], name
        assert "ports" not in services[name], name
    assert [(p["host_ip"], p["target"]) for p in gateway["ports"]] == [("127.0.0.1", 50051)]


def test_gpu_reserved_for_retrieval_ranking_and_training_only(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    for name in GPU_SERVICES:
        assert any("gpu" in d["capabilities"] for d in _gpu_devices(services[name])), name
    for name in ("features", "gateway", "locust"):
        assert _gpu_devices(services[name]) == [], name
    for name in ("gateway", "locust"):
        assert "deploy" not in services[name], name


def test_replicas_per_stage_are_settings(resolved: dict[str, Any]) -> None:
    # RECPIPE_<STAGE>_REPLICAS: what `recpipe serve --replicas STAGE=N` sets on one machine
    assert {name: resolved["services"][name]["deploy"]["replicas"] for name in SCALABLE} == dict.fromkeys(SCALABLE, 1)
    env = {f"RECPIPE_{name.upper()}_REPLICAS": str(n) for n, name in enumerate(SCALABLE, start=2)}
    scaled = resolve("docker-compose.yml", env=env)["services"]
    for n, name in enumerate(SCALABLE, start=2):
        assert scaled[name]["deploy"]["replicas"] == n, name
    assert _gpu_devices(scaled["ranking"]) == _gpu_devices(resolved["services"]["ranking"])  # kept beside it
    assert "replicas" not in scaled["gateway"].get("deploy", {})  # its host port is published once
    cpu = resolve(*CPU, env=env)["services"]
    assert cpu["ranking"]["deploy"]["replicas"] == 4 and _gpu_devices(cpu["ranking"]) == []
    # one container per service where every one binds a host port
    hostnet = resolve(*HOSTNET, env={"RECPIPE_VARIANT": "cpu", **env})["services"]
    for name in (*SCALABLE, "ranking-2"):
        assert hostnet[name]["deploy"]["replicas"] == 1, name


def test_one_image_built_from_the_dockerfile_with_a_variant(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert {s["image"] for s in services.values()} == {"recpipe:cuda"}
    assert all(s["build"]["args"]["VARIANT"] == "cuda" for s in services.values())


def test_dockerfile_picks_torch_index_per_variant_in_one_stage() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    # BuildKit would fetch a frontend image for a syntax line, which an offline machine cannot
    assert not re.search(r"^#\s*syntax=", dockerfile, re.M | re.I)
    stages = re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M)
    # the classic builder runs every stage: no stage per variant, or a CPU build downloads CUDA torch
    assert not [s for s in stages if s in ("build-cpu", "build-cuda") or "${VARIANT}" in s], stages
    torch_installs = re.findall(r'pip install "torch==\$\{TORCH_VERSION\}" --index-url (\S+)', dockerfile)
    assert torch_installs == ['"${TORCH_INDEX_URL:-$default_index}"']
    for arg in ("PYTHON_IMAGE", "TORCH_INDEX_URL", "PIP_INDEX_URL", "VARIANT"):
        assert re.search(rf"^ARG {arg}\b", dockerfile, re.M), arg


def test_cpu_variant_by_environment() -> None:
    services = resolve("docker-compose.yml", env={"RECPIPE_VARIANT": "cpu"})["services"]
    assert {s["image"] for s in services.values()} == {"recpipe:cpu"}


def test_locust_is_optional_and_data_in_a_named_volume(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert services["locust"]["profiles"] == ["loadtest"]
    assert "locust" in services["locust"]["command"][0]
    assert "artifacts" in resolved["volumes"]
    for svc in services.values():
        assert any(v["type"] == "volume" and v["source"] == "artifacts" and v["target"] == "/artifacts"
                   for v in svc["volumes"])


def test_cpu_override_drops_gpu_reservations_and_builds_cpu_image(resolved: dict[str, Any]) -> None:
    cpu = resolve(*CPU)
    assert set(cpu["services"]) == set(resolved["services"])
    for name, svc in cpu["services"].items():
        assert svc["image"] == "recpipe:cpu" and svc["build"]["args"]["VARIANT"] == "cpu", name
        assert _gpu_devices(svc) == [], name
        base = resolved["services"][name]  # nothing else changes
        assert svc["command"] == base["command"] and svc.get("environment") == base.get("environment"), name


def test_hostnet_override_keeps_all_traffic_on_loopback(hostnet: dict[str, Any]) -> None:
    services = hostnet["services"]
    assert services["init"]["network_mode"] == "none"
    for name, svc in services.items():
        assert "ports" not in svc or svc["ports"] == [], name
        if name == "init":
            continue
        assert svc["network_mode"] == "host", name
        assert "networks" not in svc, name
        if name != "locust":
            assert svc["environment"]["RECPIPE_BIND_HOST"] == "127.0.0.1", name
            assert svc["healthcheck"]["test"][4].startswith("127.0.0.1:"), name
    assert _flag(services["locust"]["command"], "--host") == "127.0.0.1:50051"
    assert _flag(services["locust"]["command"], "--web-host") == "127.0.0.1"
    env = services["gateway"]["environment"]
    assert env["RECPIPE_FEATURES_TARGET"] == "127.0.0.1:50052"
    assert env["RECPIPE_RETRIEVAL_TARGET"] == "127.0.0.1:50053"


def test_hostnet_second_ranking_replica_behind_one_target(hostnet: dict[str, Any]) -> None:
    services = hostnet["services"]
    ranking, replica = services["ranking"], services["ranking-2"]
    assert services["gateway"]["environment"]["RECPIPE_RANKING_TARGET"] == "ipv4:127.0.0.1:50054,127.0.0.1:50055"
    assert services["gateway"]["depends_on"]["ranking-2"]["condition"] == "service_healthy"
    assert replica["command"][:4] == ["recpipe", "serve", "--stage", "ranking"]
    assert _flag(replica["command"], "--port") == "50055" and _flag(ranking["command"], "--port") == "50054"
    assert replica["healthcheck"]["test"][4] == "127.0.0.1:50055"
    assert replica["image"] == ranking["image"] == "recpipe:cpu"
    assert replica["volumes"] == ranking["volumes"] and replica["depends_on"] == ranking["depends_on"]
    assert _gpu_devices(replica) == []
