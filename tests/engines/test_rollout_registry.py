"""The rollout registry and the mismatch metric (no model needed)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.rollout import (
    RolloutEngine,
    available_rollout_engines,
    create_rollout_engine,
    register_rollout_engine,
)


def vllm_installed() -> bool:
    # tests/vllm/ (a test folder without __init__.py) would otherwise pass for a namespace package named vllm
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def test_builtin_engines_are_registered():
    assert {"hf", "native", "vllm"} <= set(available_rollout_engines())


def test_unknown_engine_lists_the_registered_names():
    with pytest.raises(ValueError, match=r"unknown rollout engine 'sglang'; known: hf, native"):
        create_rollout_engine("sglang", "/nowhere")


@pytest.mark.skipif(vllm_installed(), reason="vllm is installed: the missing-package path cannot occur")
def test_vllm_without_vllm_says_how_to_install_it():
    with pytest.raises(ImportError, match=r"(?i)install"):  # the adapter, or the registry if the module is absent
        create_rollout_engine("vllm", "/nowhere")


def test_a_backend_that_cannot_be_imported_says_what_to_install():
    register_rollout_engine("missing-test", "hybridflow.engines.rollout.no_such_backend:NoSuchRollout")
    with pytest.raises(ImportError, match=r"rollout engine 'missing-test' could not be imported.*installed"):
        create_rollout_engine("missing-test", "/nowhere")


def test_register_a_class_and_pass_engine_kwargs():
    class EchoRollout(RolloutEngine):
        def __init__(self, model_path, *, dtype, seed, max_model_len, **kw):
            self.args = (model_path, dtype, seed, max_model_len, kw)

        def generate(self, prompts, params):
            return prompts

        def update_weights(self, named_tensors):
            pass

    register_rollout_engine("echo-test", EchoRollout)
    engine = create_rollout_engine("echo-test", "/m", dtype="bf16", max_model_len=64, block_size=16)
    assert engine.args == ("/m", "bf16", 0, 64, {"block_size": 16})


def test_logprob_mismatch_against_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, 5, generator=g) * 3
    train = rollout + torch.randn(3, 5, generator=g) * 0.1
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    diffs = [float(train[i, j] - rollout[i, j]) for i in range(3) for j in range(5) if mask[i, j]]
    stats = logprob_mismatch(rollout, train, mask)
    assert stats["mismatch/mean_abs"] == pytest.approx(sum(abs(d) for d in diffs) / len(diffs), rel=1e-6)
    assert stats["mismatch/max_abs"] == pytest.approx(max(abs(d) for d in diffs), rel=1e-6)
    assert stats["mismatch/kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in diffs) / len(diffs), rel=1e-5)
    assert stats["mismatch/kl"] > 0
    assert logprob_mismatch(rollout, rollout.clone(), mask) == {
        "mismatch/mean_abs": 0.0, "mismatch/max_abs": 0.0, "mismatch/kl": 0.0}
    with pytest.raises(ValueError, match="equal shapes"):
        logprob_mismatch(rollout, train[:, :4], mask)
