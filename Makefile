# Two commands for a fresh machine (see README):  make demo   |   make test
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hybridflow-installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel first: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,tracking,plot]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/hybridflow train

test: setup
	$(BIN)/ruff check hybridflow tests benchmarks examples
	$(BIN)/python -m pytest -q -x --durations=15 tests

lint: setup
	$(BIN)/ruff check hybridflow tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
