# The two commands a new machine needs: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
CONFIG ?= config.example.toml
BIN    := $(VENV)/bin

.PHONY: run test lint typecheck pytest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/geodebot serve --config $(CONFIG)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check geodebot tests bench
	$(BIN)/ruff format --check geodebot tests bench

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

# Two test files at a time, each whole on one worker (its module-scoped daemons start once).
PYTEST_WORKERS ?= 2

pytest: $(VENV)/.installed-test
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile

test: lint typecheck pytest

bench: $(VENV)/.installed-test
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/telegram_bench.py
	$(BIN)/python bench/scheduler_bench.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
