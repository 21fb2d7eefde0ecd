#!/usr/bin/env bash
# The local stand-in for python:3.11-slim-bookworm, made from Debian's own packages, for machines that reach
# Debian's mirror and PyPI but no image registry:  deploy/podman/debian-base.sh [IMAGE]  (default
# localhost/llamascope-bookworm-py). Does nothing if IMAGE already exists. Needs root, debootstrap and podman.
#
# Debian's python3 is not python:3.11-slim's: four differences are made good here, so the Dockerfile needs no
# branch for this base: Python's C headers are there (libpython3-dev; the native kernels are compiled against
# them), `python` is a command (the Dockerfile and the image's ENTRYPOINT call it), pip may install into the system
# interpreter (the EXTERNALLY-MANAGED marker of PEP 668 is removed: nothing else in this image is managed by pip),
# and the host's resolver and apt lists are not left in the image.
set -euo pipefail
image=${1:-localhost/llamascope-bookworm-py}
suite=${DEBIAN_SUITE:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if podman image exists "$image"; then
  echo "base image $image is already here"
  exit 0
fi
for tool in debootstrap podman; do
  command -v "$tool" >/dev/null || { echo "$0: $tool is missing (Debian package $tool)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "$0: debootstrap needs root" >&2; exit 1; }

work=$(mktemp -d /var/tmp/llamascope-base.XXXXXX)
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
start=$(date +%s)
# A stuck mirror must not hang the caller: debootstrap has no timeout of its own
timeout 1200 debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,libpython3-dev \
  "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -20 "$work/debootstrap.log" >&2; echo "$0: debootstrap failed" >&2; exit 1; }

ln -sf python3 "$rootfs/usr/bin/python"
rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
: >"$rootfs/etc/resolv.conf"  # the runtime mounts its own; the host's must not travel in the image
echo localhost >"$rootfs/etc/hostname"

tar --numeric-owner -C "$rootfs" -c . | podman import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --message "debootstrap --variant=minbase $suite + python3, python3-venv, python3-pip, ca-certificates, libpython3-dev" \
  - "$image" >/dev/null
echo "base image $image made from Debian $suite in $(( $(date +%s) - start )) s"
