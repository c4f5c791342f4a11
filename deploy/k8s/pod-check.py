"""The cpu overlay's pods as plain containers: what can be checked of deploy/k8s without a cluster.

    python deploy/k8s/pod-check.py      # in the project's venv, with a running Docker engine and the
                                        # recpipe:cpu image (.ci/compose-smoke.sh builds it); ~2 min

Renders the overlay with the pinned kubectl and runs its commands in the image as the pods would: uid
10001, read-only root filesystem, all capabilities dropped, no-new-privileges, a tmpfs /tmp, the
artifacts volume read-only for the stages. A Docker bridge network stands in for the cluster's DNS:
each container's alias is its Service's name, so the ConfigMap's dns:///NAME:PORT targets resolve.
In order: the init Job's command (scale 0.01), each stage's wait-for-init container, each stage; the
startup, readiness and liveness probes as the kubelet asks them (gRPC health, port and service from
the manifests); a Recommend through recpipe-gateway:50051; ranking stopped (the gateway must turn
not-ready but stay live) and started again (ready again, without a restart); then, under open-loop
load, a second ranking container under the same name, timing its first Rank call. Not checked:
scheduling, PVCs, the kubelet itself, Pod Security admission, autoscaling. Leaves nothing behind.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "recpipe:cpu"
NET, VOLUME = "recpipe-podcheck", "recpipe-podcheck-artifacts"
STAGES = ("features", "retrieval", "ranking", "gateway")
RANK_CALLS = (
    "import urllib.request; text = urllib.request.urlopen('http://127.0.0.1:51054/metrics').read().decode(); "
    "print(int(sum(float(l.rsplit(' ', 1)[1]) for l in text.splitlines() "
    "if l.startswith('recpipe_requests_total{') and 'Rank\"' in l)))"
)


class CheckFailed(Exception):
    pass


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(argv), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise CheckFailed(f"{' '.join(argv[:6])} ...: exit {out.returncode}: {out.stderr[-1500:]}")
    return out


class Pods:
    """The rendered overlay, and containers started from it the way its pods start."""

    def __init__(self) -> None:
        kubectl = Path(sys.executable).parent / "kubectl"
        text = sh(str(kubectl), "kustomize", str(ROOT / "deploy/k8s/overlays/cpu")).stdout
        docs = [d for d in yaml.safe_load_all(text) if d]
        self.env = dict(next(d for d in docs if d["kind"] == "ConfigMap")["data"])
        self.env.update(RECPIPE_SCALE="0.01", RECPIPE_TRAIN_ARGS="--epochs 1")
        self.specs: dict[str, Any] = {d["metadata"]["name"]: d["spec"]["template"]["spec"]
                                      for d in docs if d["kind"] in ("Deployment", "Job")}
        self.started: list[str] = []

    def run(self, name: str, argv: Sequence[str], *, read_only_artifacts: bool, detach: bool,
            aliases: Sequence[str] = ()) -> None:
        flags = ["docker", "run", "--name", name, "--network", NET, "--user", "10001:10001", "--read-only",
                 "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                 "-v", f"{VOLUME}:/artifacts" + (":ro" if read_only_artifacts else ""),
                 *(arg for k, v in self.env.items() for arg in ("-e", f"{k}={v}")),
                 *(arg for a in aliases for arg in ("--network-alias", a)), "-d" if detach else "--rm"]
        # the kubelet expands $(VAR) in args from the container's environment
        argv = [a.replace("$(RECPIPE_DEVICE)", self.env["RECPIPE_DEVICE"]) for a in argv]
        self.started.append(name)
        sh(*flags, "--entrypoint", argv[0], IMAGE, *argv[1:])

    def start_stage(self, stage: str, name: str | None = None) -> None:
        spec = self.specs[stage]
        for init in spec.get("initContainers", []):
            self.run(f"podcheck-{stage}-wait", init["command"], read_only_artifacts=True, detach=False)
        aliases = ("recpipe-gateway",) if stage == "gateway" else (stage,)
        self.run(name or f"podcheck-{stage}", spec["containers"][0]["args"],
                 read_only_artifacts=stage != "gateway", detach=True, aliases=aliases)

    def probe(self, stage: str, kind: str, name: str | None = None) -> bool:
        grpc = self.specs[stage]["containers"][0][kind]["grpc"]
        out = sh("docker", "exec", name or f"podcheck-{stage}", "python", "-m", "recpipe.serving.healthcheck",
                 f"127.0.0.1:{grpc['port']}", "--service", grpc.get("service", ""), check=False)
        return out.returncode == 0

    def wait(self, stage: str, kind: str, timeout_s: float, name: str | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.probe(stage, kind, name):
            if time.monotonic() > deadline:
                logs = sh("docker", "logs", name or f"podcheck-{stage}", check=False).stderr[-1500:]
                raise CheckFailed(f"{stage}: {kind} not passing after {timeout_s:g} s\n{logs}")
            time.sleep(0.5)

    def remove(self) -> None:
        for name in [*self.started, "podcheck-load"]:
            sh("docker", "rm", "-f", name, check=False)


def client(*argv: str) -> list[str]:
    return ["docker", "run", "--rm", "--network", NET, "--user", "10001:10001", "--read-only", "--tmpfs", "/tmp",
            "--cap-drop", "ALL", "--entrypoint", "recpipe", IMAGE, *argv]


def check(pods: Pods) -> None:
    t = time.monotonic()
    pods.run("podcheck-init", pods.specs["recpipe-init"]["containers"][0]["command"],
             read_only_artifacts=False, detach=False)
    print(f"init Job: trained in {time.monotonic() - t:.0f} s as uid 10001 on a read-only root; marker written")
    for stage in STAGES:
        pods.start_stage(stage)
    for stage in STAGES:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            pods.wait(stage, kind, 180)
        print(f"{stage}: started (after its wait-for-init, if any); startup, readiness and liveness probes pass")
    sh(*client("recommend", "--target", "recpipe-gateway:50051", "--user-id", "3", "--num-results", "3"))
    print("Recommend through recpipe-gateway:50051: ok")

    sh("docker", "stop", "-t", "25", "podcheck-ranking")
    time.sleep(2)  # the gateway's readiness watch polls every 0.5 s
    ready, live = pods.probe("gateway", "readinessProbe"), pods.probe("gateway", "livenessProbe")
    if ready or not live:
        raise CheckFailed(f"ranking down: gateway ready={ready} live={live}, expected not ready and live")
    sh("docker", "start", "podcheck-ranking")
    pods.wait("gateway", "readinessProbe", 60)
    print("ranking stopped: gateway not ready but live; ranking started: gateway ready again, not restarted")

    load = client("querygen", "--target", "recpipe-gateway:50051", "--mode", "open", "--rate", "20",
                  "--duration", "150", "--out", "/tmp/run.json", "--quiet", "--force")
    sh("docker", "run", "-d", "--name", "podcheck-load", *load[3:])
    time.sleep(3)
    pods.start_stage("ranking", name="podcheck-ranking-2")
    pods.wait("ranking", "readinessProbe", 60, name="podcheck-ranking-2")
    since = time.monotonic()
    while int(sh("docker", "exec", "podcheck-ranking-2", "python", "-c", RANK_CALLS).stdout) == 0:
        if time.monotonic() - since > 90:
            raise CheckFailed("the second ranking replica got no Rank call within 90 s of being ready")
        time.sleep(0.5)
    print(f"scale-up: the second ranking replica got its first Rank call {time.monotonic() - since:.1f} s "
          f"after it was ready, without a gateway restart")


def main(argv: Sequence[str] | None = None) -> int:
    if sh("docker", "image", "inspect", IMAGE, check=False).returncode != 0:
        print(f"pod-check: no {IMAGE} image (bash .ci/compose-smoke.sh builds it)", file=sys.stderr)
        return 2
    pods = Pods()
    sh("docker", "network", "create", NET)
    sh("docker", "volume", "create", VOLUME)
    try:
        check(pods)
    except CheckFailed as e:
        print(f"pod-check: FAIL: {e}", file=sys.stderr)
        return 1
    finally:
        pods.remove()
        sh("docker", "network", "rm", NET, check=False)
        sh("docker", "volume", "rm", VOLUME, check=False)
    print("pod-check: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
