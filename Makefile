# Two commands set everything up on a fresh machine:
#   make demo   private vs non-private training of a small LM on text shipped in the repo (~1 min)
#   make test   the test suite
# and: make bench (benchmarks vs non-private and Opacus, regenerates docs/benchmarks.md), make docs (site/)
# torch is pinned to 2.13.0 first so that pip never pulls a newer CUDA build onto a CPU machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test lint format bench docs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[test,dev,examples]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) examples/train_lm.py

test: install
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m pytest -q -n 2 -p no:cacheprovider

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
