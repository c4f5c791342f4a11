#!/usr/bin/env bash
# Make `docker compose` (Compose v2, 2.24 or newer: docker-compose.cpu.yml uses `!reset`) available.
#
# Already there: nothing to do. Otherwise the Docker CLI (Debian's docker.io if there is none) and
# Debian trixie's `docker-compose` package (Compose v2), unpacked as a Docker CLI plugin. bookworm
# ships only Compose v1 (1.29), which cannot read `!reset`; trixie's package is fetched with an apt
# configuration of its own, so the machine's package sources are not changed. Prints the version.
set -euo pipefail

PLUGIN_DIR=${DOCKER_CLI_PLUGIN_DIR:-/usr/local/lib/docker/cli-plugins}

compose_ok() {
  local v
  v=$(docker compose version --short 2>/dev/null) || return 1
  v=${v#v}
  [ "$(printf '%s\n' 2.24.0 "${v%%-*}" | sort -V | head -n 1)" = 2.24.0 ]
}

if command -v docker >/dev/null 2>&1 && compose_ok; then
  docker compose version
  exit 0
fi

if ! command -v docker >/dev/null 2>&1; then
  echo "compose-v2: installing the Docker CLI and engine (docker.io)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
fi

echo "compose-v2: fetching Compose v2 (Debian trixie's docker-compose) as a Docker CLI plugin" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/sources" "$work/lists/partial" "$work/cache/archives/partial"
cat > "$work/sources/trixie.sources" <<EOF
Types: deb
URIs: ${DEBIAN_MIRROR:-http://deb.debian.org/debian}
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
apt_opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$work/sources"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" update -qq
(cd "$work" && apt-get "${apt_opts[@]}" download -qq docker-compose)
dpkg-deb -x "$work"/docker-compose_*.deb "$work/root"
install -D -m 755 "$work/root/usr/libexec/docker/cli-plugins/docker-compose" "$PLUGIN_DIR/docker-compose"
compose_ok || { echo "compose-v2: $PLUGIN_DIR/docker-compose is not Compose 2.24+" >&2; exit 1; }
docker compose version
