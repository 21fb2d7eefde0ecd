#!/usr/bin/env bash
# `make image`: the CPU image IMAGE (default llamascope:cpu) from the Dockerfile. With docker where its daemon
# answers (upstream bases, the Dockerfile's defaults), otherwise with podman on a base made from Debian's packages
# (deploy/podman/build.sh, which makes that base when it is missing). CONTAINER_ENGINE=docker|podman chooses.
set -euo pipefail
cd "$(dirname "$0")/.."
image=${IMAGE:-llamascope:cpu}
engine=${CONTAINER_ENGINE:-}
if [ -z "$engine" ]; then
  if command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; then
    engine=docker
  elif command -v podman >/dev/null 2>&1; then
    engine=podman
  else
    echo "make image: neither a docker daemon that answers nor podman (Debian: apt-get install podman debootstrap runc)" >&2
    exit 1
  fi
fi
start=$(date +%s)
case "$engine" in
  docker) docker build --build-arg DEVICE=cpu -t "$image" . ;;
  podman) deploy/podman/build.sh -t "$image" . ;;
  *) echo "make image: CONTAINER_ENGINE must be docker or podman, not '$engine'" >&2; exit 1 ;;
esac
size=$("$engine" image inspect --format '{{.Size}}' "$image")
echo "make image: $image built with $engine in $(( $(date +%s) - start )) s, $(( size / 1000000 )) MB"
