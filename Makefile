# Install order matters: torch 2.13.0 first (a CPU build on the dev/CI machines), then the project,
# so that pip never resolves a bare `torch` requirement to a multi-GB CUDA build.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0

.PHONY: install install-test demo test

install:
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[hf]"

install-test:
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[test]"

demo: install
	$(PYTHON) -m moe_fx demo

test: install-test
	$(PYTHON) -m pytest -q -p no:cacheprovider tests
