#!/usr/bin/env bash
# A local Python base image for machines that cannot pull one (no reachable image registry):
# Debian bookworm minbase from the Debian mirror with debootstrap, plus python3.11, venv, pip,
# ca-certificates, libgomp1 and `python` -> python3, imported with `docker import`.
#
#   bash .ci/base-image.sh [TAG]      # default recpipe-python:3.11-bookworm; prints the tag
#   docker build --build-arg PYTHON_IMAGE=recpipe-python:3.11-bookworm ...
#
# The image trusts the host's CA bundle as well as Debian's (as any image must behind a
# TLS-intercepting proxy), so pip in a build reaches the package index the host reaches. The recipe's
# hash (this file, the suite, the mirror, the host's bundle) is a label: an image with the same hash
# is kept, anything else is rebuilt. Environment: DEBIAN_MIRROR, HOST_CA_BUNDLE (default: the bundle
# pip or OpenSSL uses here).
set -euo pipefail

TAG=${1:-recpipe-python:3.11-bookworm}
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3.11,python3-venv,python3-pip,python-is-python3,ca-certificates,libgomp1

bundle=${HOST_CA_BUNDLE:-${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-}}}}
if [ -z "$bundle" ] && command -v pip3 >/dev/null 2>&1; then
  bundle=$(pip3 config list 2>/dev/null | sed -n "s/^global\.cert='\(.*\)'$/\1/p" | head -n 1)
fi
bundle=${bundle:-/etc/ssl/certs/ca-certificates.crt}
[ -f "$bundle" ] || { echo "base-image: CA bundle $bundle not found (set HOST_CA_BUNDLE)" >&2; exit 1; }

recipe=$( { cat "$0"; echo "$SUITE $MIRROR $PACKAGES"; cat "$bundle"; } | sha256sum | cut -c1-16)
if [ "$(docker image inspect -f '{{ index .Config.Labels "io.recpipe.base-recipe" }}' "$TAG" 2>/dev/null)" = "$recipe" ]; then
  echo "base-image: $TAG is up to date (recipe $recipe)" >&2
  echo "$TAG"
  exit 0
fi

command -v debootstrap >/dev/null 2>&1 || {
  echo "base-image: installing debootstrap" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
}

root=$(mktemp -d /var/tmp/recpipe-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "base-image: debootstrap $SUITE into $root" >&2
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 || {
  tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"

# The host's trust store joins Debian's; update-ca-certificates keeps it in the bundle it rebuilds.
install -m 644 "$bundle" "$root/usr/local/share/ca-certificates/host-ca-bundle.crt"
chroot "$root" update-ca-certificates >/dev/null 2>&1
chroot "$root" python --version >/dev/null
# Documentation and translations are not needed in a service image (copyright files stay).
find "$root/usr/share/doc" -type f ! -name copyright -delete
rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
       "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
       "$root"/var/log/* "$root"/tmp/* "$root"/dev/* "$root"/proc/* "$root"/sys/*

# pip's vendored certifi does not read the system store; point it (and requests, OpenSSL) at it.
tar -C "$root" -c . | docker import \
  --change 'ENV LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change "LABEL io.recpipe.base-recipe=$recipe" \
  --change 'CMD ["python3"]' \
  - "$TAG" >/dev/null
echo "base-image: built $TAG (recipe $recipe)" >&2
echo "$TAG"
