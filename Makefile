# Install order matters: torch 2.13.0 first (a CPU build on the dev/CI machines), then the project,
# so that pip never resolves a bare `torch` requirement to a multi-GB CUDA build.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
# One transformers for the demo and the tests (the expect-inline graph tests print its code): the
# version the `test` extra pins in pyproject.toml.
TRANSFORMERS_VERSION ?= 5.24.0
# pytest-xdist workers: the suite is single-threaded Python (Dynamo tracing, the Triton interpreter), so
# one worker per core of the 2-core CI machine halves its wall time.
TEST_WORKERS ?= 2

.PHONY: install install-test demo test

install:
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[hf]" "transformers==$(TRANSFORMERS_VERSION)"

install-test:
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[test]" "transformers==$(TRANSFORMERS_VERSION)"

demo: install
	$(PYTHON) -m moe_fx demo

test: install-test
	$(PYTHON) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) tests
