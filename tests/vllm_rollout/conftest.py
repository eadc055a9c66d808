"""Fixtures for the vLLM rollout tests; run with the vLLM virtualenv: `.venv-vllm/bin/python -m pytest tests/vllm_rollout`.

These tests run vLLM for real (the CPU build on CI). They are not part of the main suite (its venv has no vLLM): there,
`pytest tests --ignore=tests/vllm_rollout`. Collected without vLLM, this directory fails loudly instead of skipping.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from vllm_test_utils import KV_CACHE_GIB, MAX_MODEL_LEN, write_peaked_model

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # origin None: only this directory, found as a namespace package
    raise ImportError(
        "tests/vllm_rollout needs vLLM: build its virtualenv with `bash scripts/setup_vllm_env.sh`, then run "
        "`.venv-vllm/bin/python -m pytest tests/vllm_rollout` (the main suite runs with --ignore=tests/vllm_rollout)"
    )

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's CPU performance hints drown the test output
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> str:
    return write_peaked_model(tmp_path_factory.mktemp("vllm_tiny_a"), seed=0)


@pytest.fixture(scope="session")
def other_model_path(tmp_path_factory) -> str:
    """Same architecture, different weights: the target of the weight-swap tests."""
    return write_peaked_model(tmp_path_factory.mktemp("vllm_tiny_b"), seed=1)


@pytest.fixture(scope="session")
def fp32_engine(model_path):
    """One fp32 vLLM engine for the whole session (start-up costs seconds on 2 cores); tests must leave its weights
    as they found them."""
    from hybridflow.engines.rollout.vllm_rollout import VLLMRollout

    engine = VLLMRollout(model_path, dtype="fp32", seed=0, max_model_len=MAX_MODEL_LEN, kv_cache_space_gib=KV_CACHE_GIB)
    yield engine
    engine.shutdown()
