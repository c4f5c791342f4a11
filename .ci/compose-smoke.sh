#!/usr/bin/env bash
# docker compose, for real: build the CPU image and bring the whole stack up on this machine.
#
#   bash .ci/compose-smoke.sh
#
# Installs the Docker engine and Compose v2 if missing and starts dockerd if none runs (and stops the
# one it started); builds the local base image (.ci/base-image.sh: no image registry is needed) and
# the CPU image, with torch from a PEP 503 index served on 127.0.0.1 out of pip's local wheels; brings
# the stack up with docker-compose.hostnet.yml (host networking, every address 127.0.0.1, two ranking
# replicas) at a small scale, every container as user 10001 with a read-only root filesystem and no
# capabilities (checked); waits, bounded, for every service to be healthy; sends a Recommend and
# `recpipe querygen --queries 200` (0 errors) from the host, then a closed loop of 8 clients; checks
# that both ranking replicas served Rank calls (their Prometheus counters: lone queries all meet the
# first, the second takes batches while the first is busy), and that a second `up` does not retrain;
# `down -v`; then
# runs deploy/k8s/pod-check.py (the cpu overlay's pods as containers of the same image).
# Where dockerd cannot start it says so and exits 0 (the only skip); anything else that fails, fails.
#
# Environment: RECPIPE_SMOKE_SCALE (dataset scale, default 0.02), RECPIPE_SMOKE_TRAIN_ARGS (default
# "--epochs 1"), RECPIPE_SMOKE_CACHE (the torch index, default /var/cache/recpipe-smoke),
# RECPIPE_SMOKE_INDEX_PORT (its port on 127.0.0.1, default 50990, a free one if taken),
# RECPIPE_PYTHON (an interpreter with recpipe for the host-side checks; default .venv's, else the
# image's, run with host networking). Images and Docker's layer cache are kept between runs; the
# stack, its volume and any dockerd this script started are not.
set -euo pipefail
cd "$(dirname "$0")/.."

SCALE=${RECPIPE_SMOKE_SCALE:-0.02}
TRAIN_ARGS=${RECPIPE_SMOKE_TRAIN_ARGS:---epochs 1}
CACHE=${RECPIPE_SMOKE_CACHE:-/var/cache/recpipe-smoke}
TORCH_VERSION=2.13.0
IMAGE=recpipe:cpu
INDEX_PORT_DEFAULT=${RECPIPE_SMOKE_INDEX_PORT:-50990}
PORTS=(50051 50052 50053 50054 50055 51051 51052 51053 51054 51055)
COMPOSE=(docker compose -p recpipe-smoke -f docker-compose.yml -f docker-compose.cpu.yml -f docker-compose.hostnet.yml)
export RECPIPE_VARIANT=cpu RECPIPE_SCALE=$SCALE RECPIPE_TRAIN_ARGS=$TRAIN_ARGS
export DOCKER_BUILDKIT=0  # the classic builder: BuildKit may want to fetch images of its own

T0=$(date +%s)
declare -a TIMES=()
log() { echo "compose-smoke: $*"; }
since() { echo $(( $(date +%s) - $1 )); }
timed() { TIMES+=("$(printf '%-22s %4ss' "$1" "$2")"); log "$1: $2 s"; }
fail() { echo "compose-smoke: FAIL: $*" >&2; exit 1; }

STARTED_DOCKERD= INDEX_PID= STACK_UP= WORK=$(mktemp -d)
cleanup() {
  local rc=$?
  set +e
  if [ -n "$STACK_UP" ]; then
    if [ "$rc" != 0 ]; then
      echo "---- compose ps / logs (last 40 lines per service) ----" >&2
      "${COMPOSE[@]}" ps -a >&2
      timeout 60 "${COMPOSE[@]}" logs --no-color --tail 40 >&2
    fi
    timeout 120 "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || log "down -v did not finish"
  fi
  [ -n "$INDEX_PID" ] && kill "$INDEX_PID" 2>/dev/null
  if [ -n "$STARTED_DOCKERD" ]; then
    kill "$STARTED_DOCKERD" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$STARTED_DOCKERD" 2>/dev/null && log "dockerd ($STARTED_DOCKERD) still stopping"
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT

# ---- engine and Compose v2 ---------------------------------------------------------------------
if ! command -v dockerd >/dev/null 2>&1; then
  log "installing the Docker engine (docker.io)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io) >"$WORK/apt.log" 2>&1 \
    || { tail -n 20 "$WORK/apt.log" >&2; fail "could not install docker.io"; }
fi
bash .ci/compose-v2.sh >/dev/null

if ! timeout 10 docker info >/dev/null 2>&1; then
  log "starting dockerd"
  dockerd >"$WORK/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 60); do
    timeout 5 docker info >/dev/null 2>&1 && break
    kill -0 "$STARTED_DOCKERD" 2>/dev/null || break
    sleep 0.5
  done
  if ! timeout 10 docker info >/dev/null 2>&1; then
    echo "compose-smoke: SKIP: dockerd cannot start on this machine; the compose stack was not run. dockerd said:" >&2
    tail -n 15 "$WORK/dockerd.log" >&2
    STARTED_DOCKERD=$(kill -0 "$STARTED_DOCKERD" 2>/dev/null && echo "$STARTED_DOCKERD" || true)
    exit 0
  fi
fi
log "$(docker version -f 'engine {{.Server.Version}}') ($(docker info -f '{{.Driver}}, {{.CgroupDriver}}')), $(docker compose version)"

for port in "${PORTS[@]}"; do  # host networking: the stack's ports must be free
  python3 -c "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', int(sys.argv[1])))" "$port" 2>/dev/null \
    || fail "127.0.0.1:$port is in use; docker-compose.hostnet.yml needs ports ${PORTS[*]}"
done

# ---- images --------------------------------------------------------------------------------------
t=$(date +%s)
BASE=$(bash .ci/base-image.sh)
timed "base image" "$(since "$t")"
log "$BASE: $(docker image inspect -f '{{.Size}}' "$BASE" | awk '{printf "%.0f MB", $1/1e6}')"

# torch and its dependencies from pip's own sources (the CPU wheel lies on this machine's disk), served
# as a PEP 503 index on loopback for the build, which runs in the host's network namespace.
t=$(date +%s)
index=$CACHE/torch-$TORCH_VERSION
if ! compgen -G "$index/files/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null; then
  rm -rf "$index" && mkdir -p "$index/files"
  python3 -m pip download -q --only-binary=:all: --python-version 3.11 -d "$index/files" "torch==$TORCH_VERSION" \
    >"$WORK/pip.log" 2>&1 || { tail -n 20 "$WORK/pip.log" >&2; fail "pip download torch==$TORCH_VERSION"; }
  compgen -G "$index/files/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null \
    || fail "pip found no CPU build of torch $TORCH_VERSION (got: $(ls "$index/files" | grep '^torch-'))"
fi
rm -rf "$index/simple"
for wheel in "$index"/files/*.whl; do
  file=${wheel##*/}
  name=$(echo "${file%%-*}" | tr 'A-Z_.' 'a-z--')  # PEP 503 normalised project name
  mkdir -p "$index/simple/$name"
  echo "<a href=\"../../files/${file//+/%2B}\">$file</a>" >>"$index/simple/$name/index.html"
done
# A fixed port where it is free: the index URL is a build argument, and a new one would invalidate
# Docker's cache of every layer from the torch install on.
INDEX_PORT=$(python3 -c "import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(('127.0.0.1', $INDEX_PORT_DEFAULT))
except OSError:
    s.bind(('127.0.0.1', 0))
print(s.getsockname()[1])")
python3 -m http.server --bind 127.0.0.1 --directory "$index" "$INDEX_PORT" >"$WORK/index.log" 2>&1 &
INDEX_PID=$!
for _ in $(seq 20); do
  python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$INDEX_PORT/simple/torch/" 2>/dev/null && break
  sleep 0.25
done
log "torch index on 127.0.0.1:$INDEX_PORT ($(ls "$index/files" | wc -l) wheels)"

timeout 1200 docker build --network host -t "$IMAGE" --build-arg VARIANT=cpu --build-arg "PYTHON_IMAGE=$BASE" \
    --build-arg "TORCH_INDEX_URL=http://127.0.0.1:$INDEX_PORT/simple" . 2>&1 \
    | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done >"$WORK/build.log" \
  || { cp "$WORK/build.log" "$CACHE/last-build.log"; tail -n 40 "$WORK/build.log" >&2; fail "docker build"; }
cp "$WORK/build.log" "$CACHE/last-build.log"  # timestamped, for a look at where the time went
kill "$INDEX_PID" && INDEX_PID=
timed "CPU image build" "$(since "$t")"
log "$IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"

# ---- the stack ------------------------------------------------------------------------------------
PY=${RECPIPE_PYTHON:-}
if [ -z "$PY" ] && [ -x .venv/bin/python ] && .venv/bin/python -c "import recpipe" 2>/dev/null; then
  PY=.venv/bin/python
fi
host_recpipe() {  # recpipe on the host (or in the image, in the host's network namespace)
  if [ -n "$PY" ]; then "$PY" -m recpipe "$@"
  else docker run --rm --network host --user 0 -v "$WORK:$WORK" "$IMAGE" recpipe "$@"; fi
}

wait_healthy() {  # wait_healthy SECONDS: every long-running service healthy, init exited 0
  local deadline=$(( $(date +%s) + $1 )) svc id state
  while :; do
    local pending=()
    for svc in features retrieval ranking ranking-2 gateway; do
      id=$("${COMPOSE[@]}" ps -q "$svc" 2>/dev/null)
      state=$([ -n "$id" ] && docker inspect -f '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$id")
      [ "$state" = "running/healthy" ] || pending+=("$svc:${state:-absent}")
    done
    id=$("${COMPOSE[@]}" ps -a -q init)
    state=$(docker inspect -f '{{.State.Status}}/{{.State.ExitCode}}' "$id")
    case $state in exited/0) ;; exited/*) fail "init failed ($state)";; *) pending+=("init:$state");; esac
    [ ${#pending[@]} = 0 ] && return 0
    [ "$(date +%s)" -lt "$deadline" ] || fail "not healthy within $1 s: ${pending[*]}"
    sleep 2
  done
}

t=$(date +%s)
STACK_UP=1
"${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true  # leftovers of an interrupted run
# `up` returns once init has trained and the stages it must wait for are healthy, so it is bounded too.
timeout 600 "${COMPOSE[@]}" up -d --no-build --quiet-pull >"$WORK/up.log" 2>&1 \
  || { cat "$WORK/up.log" >&2; fail "docker compose up"; }
wait_healthy 300
timed "up (healthy)" "$(since "$t")"

# Every container as deploy/k8s runs its pods: user 10001, read-only root filesystem, no capabilities.
for svc in init features retrieval ranking ranking-2 gateway; do
  id=$("${COMPOSE[@]}" ps -a -q "$svc")
  conf=$(docker inspect -f '{{.Config.User}} ro={{.HostConfig.ReadonlyRootfs}} drop={{.HostConfig.CapDrop}}' "$id")
  [ "$conf" = "10001:10001 ro=true drop=[ALL]" ] || fail "$svc runs as '$conf', not '10001:10001 ro=true drop=[ALL]'"
done
[ "$("${COMPOSE[@]}" exec -T ranking id -u)" = 10001 ] || fail "ranking's process is not uid 10001"
root_mount=$("${COMPOSE[@]}" exec -T ranking awk '$2 == "/" {split($4, o, ","); print o[1]}' /proc/mounts)
[ "$root_mount" = ro ] || fail "ranking's root filesystem is mounted '$root_mount', not read-only"
log "every container: uid 10001, read-only root filesystem, all capabilities dropped"

t=$(date +%s)
host_recpipe recommend --target 127.0.0.1:50051 --user-id 3 --num-results 5 >"$WORK/recommend.txt" \
  || { cat "$WORK/recommend.txt" >&2; fail "Recommend from the host"; }
timed "first Recommend" "$(since "$t")"
head -n 15 "$WORK/recommend.txt"

t=$(date +%s)
host_recpipe querygen --target 127.0.0.1:50051 --queries 200 --out "$WORK/querygen.json" --force --quiet \
  || fail "recpipe querygen"
read -r queries errors < <(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['queries'], d['errors'])" \
  "$WORK/querygen.json")
[ "$queries" = 200 ] && [ "$errors" = 0 ] || fail "querygen: $queries queries, $errors errors"
timed "querygen 200 queries" "$(since "$t")"

rank_calls() {  # rank_calls METRICS_PORT: Rank calls the ranking server on that port received (Rank, RankBatch, RankStream messages)
  python3 - "$1" <<'EOF'
import re, sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
print(int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("recpipe_requests_total{") and re.search(r'method="[^"]*/Rank(Batch|Stream)?"', line))))
EOF
}
# the gateway sends each Rank batch to the first ranking replica with none of its calls out: lone
# queries all meet ranking, and ranking-2 works once queries overlap (batches that travel together
# leave it the stragglers: 3-8 of ~215 calls with 8 clients for 3 s, 4-17 with 16 clients for 5 s, so
# up to three such loops until it has had one)
for attempt in 1 2 3; do
  host_recpipe querygen --target 127.0.0.1:50051 --mode closed --concurrency 16 --duration 5 \
    --out "$WORK/closed.json" --force --quiet || fail "recpipe querygen --mode closed"
  r1=$(rank_calls 51054) r2=$(rank_calls 51055)
  log "Rank calls after closed loop $attempt: ranking $r1, ranking-2 $r2"
  [ "$r2" -gt 0 ] && break
done
[ "$r1" -gt 0 ] && [ "$r2" -gt 0 ] || fail "the gateway did not use both ranking replicas ($r1 / $r2)"

# A second `up`: init runs again, finds the trained repository and exits without training.
init_id=$("${COMPOSE[@]}" ps -a -q init)
started=$(docker inspect -f '{{.State.StartedAt}}' "$init_id")
manifest=$("${COMPOSE[@]}" exec -T ranking sha256sum /artifacts/models/manifest.json)
timeout 300 "${COMPOSE[@]}" up -d --no-build >"$WORK/up2.log" 2>&1 || { cat "$WORK/up2.log" >&2; fail "second up"; }
wait_healthy 120
[ "$(docker inspect -f '{{.State.StartedAt}}' "$init_id")" != "$started" ] || fail "the second up did not run init"
init_log=$(docker logs "$init_id" 2>&1)
grep -q "already trained, nothing to do" <<<"$init_log" || fail "init did not find the trained models"
[ "$("${COMPOSE[@]}" exec -T ranking sha256sum /artifacts/models/manifest.json)" = "$manifest" ] \
  || fail "the second up retrained (manifest changed)"
log "second up: init found the models and did not retrain"

t=$(date +%s)
timeout 120 "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || fail "down -v"
STACK_UP=
timed "down -v" "$(since "$t")"

# deploy/k8s's cpu overlay, its pods as plain containers of the same image (deploy/k8s/pod-check.py:
# the init Job, wait-for-init, the gRPC probes, a stage outage, a scale-up); needs the venv's kubectl.
t=$(date +%s)
if [ -n "$PY" ]; then
  "$PY" deploy/k8s/pod-check.py || fail "deploy/k8s/pod-check.py"
  timed "k8s pod check" "$(since "$t")"
else
  log "k8s pod check not run: it needs the project's venv (.venv with the dev extra)"
fi
timed "total" "$(since "$T0")"
printf '  %s\n' "${TIMES[@]}"
log "PASS"
