PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test lint docs docs-serve docs-plots bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-default: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[default]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@ $(VENV)/.installed-default

run: $(VENV)/.installed-default
	$(BIN)/envfleet run ALE/Pong-v5 --num-envs 8 --steps 20000

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check envfleet tests bench examples docs/hooks.py
	$(BIN)/ruff format --check envfleet tests bench examples docs/hooks.py
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -n 2 --durations=12

# The documentation site (MkDocs, Material, mkdocstrings): site/. --strict turns a broken link or
# an unreadable docstring into an error. tests/test_readme.py and tests/test_docs_api.py build it
# too, under `make test`.
# `make docs` needs only the docs extra (MkDocs and the library itself, not torch or Ray).
$(VENV)/.installed-docs: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[docs]"
	touch $@

docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# The plot on docs/benchmarks.md, written by `envfleet bench` (one to two minutes on 2 cores).
docs-plots: $(VENV)/.installed-dev
	$(BIN)/envfleet bench CartPole-v1 --num-envs 8,32,64 --out docs/assets/bench-cartpole

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) build site *.egg-info
