# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create the virtualenv .venv at the repo root and install what they need into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is pinned inside pyproject's `worker` extra, so it is part of this same install
# and nothing can pull a CUDA build of torch instead.
$(VENV)/.installed-worker: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[worker]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@ $(VENV)/.installed-worker

demo: $(VENV)/.installed-worker
	$(BIN)/bulkinfer demo

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

# mypy with no arguments checks the packages pyproject.toml's [tool.mypy] names (bulkinfer.api, .jobs,
# .worker, .engine, .benchmarks), each file once, by its package name.
typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .mypy_cache
