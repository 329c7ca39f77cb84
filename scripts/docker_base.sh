#!/usr/bin/env bash
# The Debian base image the Dockerfile builds on; prints the name to pass as BASE_IMAGE.
# Usage: scripts/docker_base.sh [IMAGE]   (default debian:bookworm-slim)
#
# IMAGE is used when it is already local or can be pulled. Where no registry is reachable (Docker
# Hub is blocked on the development and CI machines), a bookworm base is made once with
# debootstrap from the machine's own Debian mirror and kept as d3d-base:SUITE; later calls reuse it.
# The Dockerfile needs only apt and a Debian release whose python3 is 3.11 (bookworm).
# Environment: DEBIAN_SUITE (bookworm), DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR (default: read
# from /etc/apt/sources.list*, else deb.debian.org), DOCKER (docker).
set -euo pipefail
image=${1:-debian:bookworm-slim}
docker=${DOCKER:-docker}
suite=${DEBIAN_SUITE:-bookworm}
local_image="d3d-base:$suite"

have() { "$docker" image inspect "$1" >/dev/null 2>&1; }

if have "$image"; then echo "$image"; exit 0; fi
if "$docker" pull -q "$image" >/dev/null 2>&1; then echo "$image"; exit 0; fi
if have "$local_image"; then
  echo "docker_base: $image cannot be pulled; using the local $local_image" >&2
  echo "$local_image"
  exit 0
fi

# The first mirror URI (deb822 "URIs:" or one-line "deb URI") on this machine that ends in $1.
mirror_of() {
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
    2>/dev/null | grep -oE '(URIs:|^deb)[[:space:]]+[^[:space:]]+' | awk '{print $2}' \
    | grep -E "/$1/?\$" | head -n1 || true
}
mirror=${DEBIAN_MIRROR:-$(mirror_of debian)}
mirror=${mirror:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-$(mirror_of debian-security)}
security=${security:-http://deb.debian.org/debian-security}

command -v debootstrap >/dev/null || { echo "docker_base: install debootstrap" >&2; exit 1; }
echo "docker_base: $image cannot be pulled; making $local_image with debootstrap from $mirror" >&2
root=$(mktemp -d /tmp/d3d-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase "$suite" "$root" "$mirror" >&2
cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb $security $suite-security main
EOF
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
tar -C "$root" --numeric-owner -c . \
  | "$docker" import -c 'CMD ["bash"]' -m "debootstrap --variant=minbase $suite $mirror" - \
    "$local_image" >/dev/null
echo "$local_image"
