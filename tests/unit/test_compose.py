"""docker-compose.yml: valid for the Compose client, and wired the way the deployment needs.

The checks use Debian's ``docker-compose`` (v1.29), which validates and resolves a compose file without
a Docker engine; they are skipped where it is not installed (.ci/run installs it). Its resolved output
is YAML, read with the YAML library that ships with it (the project itself does not depend on one).
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
COMPOSE = shutil.which("docker-compose")
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="docker-compose client not installed")

STAGE_PORTS = {"gateway": 50051, "features": 50052, "retrieval": 50053, "ranking": 50054}
SCALABLE = ("features", "retrieval", "ranking")
GPU_SERVICES = ("init", "retrieval", "ranking")  # init trains on the GPU where there is one

# Loads YAML with the compose client's own interpreter; `!reset` (Compose v2.24+) becomes
# {"__reset__": value} so the CPU override can be checked too.
_YAML_TO_JSON = """
import json, sys, yaml
class Loader(yaml.SafeLoader):
    pass
def reset(loader, node):
    value = loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else (
        loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else loader.construct_scalar(node))
    return {"__reset__": value}
Loader.add_constructor("!reset", reset)
print(json.dumps(yaml.load(sys.stdin, Loader=Loader)))
"""


def _compose_python() -> str:
    assert COMPOSE is not None
    first = Path(COMPOSE).read_text(errors="replace").splitlines()[0]
    if not first.startswith("#!") or "python" not in first:
        pytest.skip(f"{COMPOSE} is not the Python docker-compose; cannot borrow its YAML reader")
    return first[2:].strip().split()[0]


def load_yaml(text: str) -> Any:
    out = subprocess.run([_compose_python(), "-c", _YAML_TO_JSON], input=text, capture_output=True, text=True,
                         check=True, timeout=60)
    return json.loads(out.stdout)


def compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert COMPOSE is not None
    return subprocess.run([COMPOSE, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=env)


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    """docker-compose.yml as the client resolves it (anchors merged, variables at their defaults)."""
    out = compose("-f", "docker-compose.yml", "config")
    assert out.returncode == 0, out.stderr
    return load_yaml(out.stdout)


def test_compose_file_is_valid() -> None:
    out = compose("-f", "docker-compose.yml", "config", "-q")
    assert out.returncode == 0, out.stderr


def test_invalid_compose_file_is_rejected(tmp_path: Path) -> None:
    # the validation above can fail: a misspelt depends_on condition is refused
    broken = (ROOT / "docker-compose.yml").read_text().replace(
        "service_completed_successfully", "service_completed_sucessfully", 1)
    (tmp_path / "docker-compose.yml").write_text(broken)
    out = subprocess.run([str(COMPOSE), "-f", str(tmp_path / "docker-compose.yml"), "config", "-q"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0


def test_stages_wait_for_init_and_check_health_on_their_own_port(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert "restart" not in services["init"] or services["init"]["restart"] == "no"
    for name, port in STAGE_PORTS.items():
        svc = services[name]
        assert svc["depends_on"]["init"]["condition"] == "service_completed_successfully", name
        command = svc["command"]
        assert command[:4] == ["recpipe", "serve", "--stage", name], command
        assert command[command.index("--port") + 1] == str(port)
        assert command[command.index("--host") + 1] == "0.0.0.0"
        test = svc["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "recpipe.healthcheck"] and test[4] == f"127.0.0.1:{port}", test
    for name in SCALABLE:
        assert services["gateway"]["depends_on"][name]["condition"] == "service_healthy"


def test_gateway_reaches_stages_by_dns_so_replicas_share_load(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    command = services["gateway"]["command"]
    for name in SCALABLE:
        assert command[command.index(f"--{name}") + 1] == f"dns:///{name}:{STAGE_PORTS[name]}"
    for name in SCALABLE:  # `--scale NAME=3` needs no fixed name and no host port
        assert "container_name" not in services[name], name
        assert "ports" not in services[name], name


def test_gpu_reserved_for_retrieval_ranking_and_training_only(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    for name in GPU_SERVICES:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] for d in devices), name
    for name in ("features", "gateway", "locust"):
        assert "deploy" not in services[name], name


def test_one_image_built_from_the_dockerfile_with_a_variant(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    images = {s["image"] for s in services.values()}
    assert images == {"recpipe:cuda"}
    assert all(s["build"]["args"]["VARIANT"] == "cuda" for s in services.values())
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM build-\$\{VARIANT\} AS build$", dockerfile, re.M)
    assert {"build-cpu", "build-cuda"} <= set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M))


def test_cpu_variant_by_environment() -> None:
    out = compose("-f", "docker-compose.yml", "config", env={**os.environ, "RECPIPE_VARIANT": "cpu"})
    assert out.returncode == 0, out.stderr
    services = load_yaml(out.stdout)["services"]
    assert {s["image"] for s in services.values()} == {"recpipe:cpu"}


def test_locust_is_optional_and_data_in_a_named_volume(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert services["locust"]["profiles"] == ["loadtest"]
    assert "locust" in services["locust"]["command"][0]
    assert "artifacts" in resolved["volumes"]
    for svc in services.values():
        assert any(v.startswith("artifacts:/artifacts") for v in svc["volumes"])


def test_cpu_override_drops_gpu_reservations_and_builds_cpu_image(tmp_path: Path, resolved: dict[str, Any]) -> None:
    override = load_yaml((ROOT / "docker-compose.cpu.yml").read_text())["services"]
    assert set(override) == set(resolved["services"])
    merged = json.loads(json.dumps(resolved))
    for name, svc in override.items():
        assert svc["build"]["args"]["VARIANT"] == "cpu" and svc["image"] == "recpipe:cpu", name
        target = merged["services"][name]
        target["image"] = svc["image"]
        target["build"]["args"]["VARIANT"] = "cpu"
        if name in GPU_SERVICES:
            reservations = svc["deploy"]["resources"]["reservations"]
            assert reservations["devices"] == {"__reset__": []}, name
            del target["deploy"]["resources"]["reservations"]["devices"]
        else:
            assert "deploy" not in svc
    # The merge as Compose v2 does it (v1 cannot read `!reset`) is still a valid deployment.
    (tmp_path / "merged.yml").write_text(json.dumps(merged))
    out = subprocess.run([str(COMPOSE), "-f", str(tmp_path / "merged.yml"), "config", "-q"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
