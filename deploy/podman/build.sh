#!/usr/bin/env bash
# podman build for machines that reach PyPI and Debian's mirror but no image registry: the Dockerfile on a base made
# from Debian's packages (deploy/podman/debian-base.sh, made here when missing), with this host's pip settings.
#   deploy/podman/build.sh -t llamascope:cpu [more podman build arguments...] CONTEXT
# The CPU image by default (DEVICE=cpu); later --build-arg arguments override these.
#
# pip inside the build gets two things from pip on this host (`pip config list`, read now, never written down):
# - the CA bundle it trusts (`cert`), mounted read-only over the base's own bundle, which Debian's pip reads;
# - the find-links folder holding the CPU wheel of the Dockerfile's torch pin, mounted read-only at /mnt, with
#   PIP_FIND_LINKS=/mnt for the torch step: torch then comes from there and its dependencies from the index.
# Both mounts go over paths the base already has: podman 4.3 (buildah 1.28) leaves the mount point of a path the
# image lacks in the layer (an empty /etc/pip.conf or /opt/wheels in the image), and nothing of this host may reach
# the image. Nothing of it reaches the Dockerfile either: a `docker build` with upstream bases sees only its defaults.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
base=${BASE_IMAGE:-localhost/llamascope-bookworm-py}
python=${PYTHON:-python3}

"$here/debian-base.sh" "$base"

settings=$("$python" - "$here/../../Dockerfile" <<'PY'
import glob, os, re, subprocess, sys

listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
rank = {":env:": 3, "site": 2, "user": 1, "global": 0}  # PIP_* variables over the configuration files
best: dict[str, tuple[int, str]] = {}
for line in listing.splitlines():
    m = re.fullmatch(r"([^=]+)\.([\w-]+)='(.*)'", line.strip())
    if m and (m[2] not in best or rank.get(m[1], 0) >= best[m[2]][0]):
        best[m[2]] = (rank.get(m[1], 0), m[3])
get = lambda key: best.get(key, (0, ""))[1]
cert = get("cert")
if cert and not os.path.isfile(cert):
    sys.exit(f"pip's configured cert {cert} is not a file")
pin = re.search(r"^ARG TORCH_VERSION=(\S+)", open(sys.argv[1]).read(), re.M)[1]
folders = [p.removeprefix("file://") for p in get("find-links").split() if not re.match(r"^https?:", p)]
wheels = [w for p in folders for w in sorted(glob.glob(os.path.join(p, f"torch-{pin}+cpu-*.whl")))]
print(f"cert={cert}")
print(f"wheels={os.path.dirname(wheels[0]) if wheels else ''}")
print(f"index={get('index-url') or 'https://pypi.org/simple'}")
print(f"pin={pin}")
PY
)
cert=$(sed -n 's/^cert=//p' <<<"$settings")
wheels=$(sed -n 's/^wheels=//p' <<<"$settings")
index=$(sed -n 's/^index=//p' <<<"$settings")
pin=$(sed -n 's/^pin=//p' <<<"$settings")

args=(--build-arg DEVICE=cpu --build-arg "PYTHON_IMAGE=$base")
if [ -n "$cert" ]; then
  args+=(-v "$cert:/etc/ssl/certs/ca-certificates.crt:ro")
fi
if [ -n "$wheels" ]; then
  args+=(-v "$wheels:/mnt:ro" --build-arg PIP_FIND_LINKS=/mnt --build-arg "TORCH_INDEX_URL=$index")
  echo "build: torch $pin (CPU) from $wheels, the rest from $index; CA bundle ${cert:-the base's own}"
else
  echo "build: torch $pin from the Dockerfile's TORCH_INDEX_URL (no torch-$pin+cpu wheel in pip's find-links); CA bundle ${cert:-the base's own}"
fi

# --format docker: the OCI format has no HEALTHCHECK (podman would drop it); --isolation chroot and --network host:
# what builds in a VM without nested cgroups or a bridge for the RUN steps.
exec podman build --isolation chroot --network host --format docker --layers "${args[@]}" "$@"
