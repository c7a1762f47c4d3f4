PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test lint bench clean

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
	$(BIN)/ruff check envfleet tests bench examples
	$(BIN)/ruff format --check envfleet tests bench examples
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
