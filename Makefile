# Two commands set everything up on a fresh machine:
#   make demo   private vs non-private training of a small LM on text shipped in the repo (~1 min)
#   make test   the test suite (lint, then pytest; then pytest again in an environment without triton)
# and: make bench (benchmarks vs non-private and Opacus, regenerates docs/benchmarks.md), make docs (site/)
# torch is pinned to 2.13.0 first so that pip never pulls a newer CUDA build onto a CPU machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# a second environment without triton, with flashdp installed from its wheel (not editable): what a user gets
# where triton is not installed (macOS, Windows)
BARE_VENV ?= .venv-no-triton
BARE_PY := $(BARE_VENV)/bin/python
TORCH_VERSION ?= 2.13.0
PYTEST := -m pytest -q -n 2 -p no:cacheprovider

.PHONY: install demo test test-main test-no-triton lint format bench docs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[test,dev,examples,kernels,docs]"
	touch $@

$(BARE_VENV)/.installed: pyproject.toml $(shell find src -name '*.py')
	$(PYTHON) -m venv $(BARE_VENV)
	$(BARE_PY) -m pip install --quiet --upgrade pip
	$(BARE_PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(BARE_PY) -m pip install --quiet ".[test,examples]"
	@! $(BARE_PY) -c "import triton" 2>/dev/null || (echo "triton is installed in $(BARE_VENV)"; exit 1)
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) examples/train_lm.py

test: test-main test-no-triton

test-main: install
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) $(PYTEST)

test-no-triton: $(BARE_VENV)/.installed
	$(BARE_PY) $(PYTEST)

lint: install
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples

format: install
	$(PY) -m ruff format src tests examples

bench: install
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/run.py

docs: install
	$(PY) -m pip install --quiet -e ".[docs]"
	$(PY) -m mkdocs build --strict
