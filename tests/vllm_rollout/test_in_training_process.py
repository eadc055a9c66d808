"""A bf16 vLLM engine built inside a training process leaves that process's RNG and thread control alone, and its
log-probs are close to (not equal to) the fp32 training engine's: the train-inference mismatch is measured here."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from vllm_test_utils import KV_CACHE_GIB, MAX_MODEL_LEN, encode_prompts, hf_greedy, hf_model, hf_token_log_probs

from hybridflow.engines.rollout.base import SamplingParams

PROMPTS = ["The quick brown fox", "1+1=", "Once upon a time, in a land far away,"]


def rng_snapshot():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


def same_rng(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and torch.equal(a[2], b[2])


@pytest.fixture(scope="module")
def built(model_path):
    """Build a bf16 engine the way a trainer would, recording what the process looked like before and after."""
    from hybridflow.engines.rollout.vllm_rollout import VLLMRollout

    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    before = rng_snapshot()
    set_num_threads = torch.set_num_threads
    engine = VLLMRollout(model_path, dtype="bf16", seed=0, max_model_len=MAX_MODEL_LEN, kv_cache_space_gib=KV_CACHE_GIB)
    after = rng_snapshot()
    yield {"engine": engine, "rng_before": before, "rng_after": after, "set_num_threads": set_num_threads}
    engine.shutdown()


def test_construction_keeps_global_rng(built):
    # vLLM re-seeds python/numpy/torch with its own seed (0) at start-up; the caller's states must survive.
    assert same_rng(built["rng_before"], built["rng_after"])


def test_torch_set_num_threads_still_works(built):
    assert torch.set_num_threads is built["set_num_threads"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_generate_keeps_global_rng(built):
    torch.manual_seed(99)
    before = rng_snapshot()
    built["engine"].generate(encode_prompts(PROMPTS)[0], SamplingParams(temperature=1.0, n=2, max_new_tokens=8))
    assert same_rng(before, rng_snapshot())


def test_bf16_vs_fp32_training_log_probs(built, model_path):
    """bf16 rollout vs an fp32 HF forward of the same tokens: close (~1e-2), not equal. Greedy agreement is measured."""
    engine = built["engine"]
    prompts, _ = encode_prompts(PROMPTS)
    temperature = 1.0
    out = engine.generate(prompts, SamplingParams(temperature=temperature, n=4, max_new_tokens=32, seed=0))
    mask = out.batch["response_mask"].bool()
    model = hf_model(model_path)
    ref = hf_token_log_probs(model, out.batch["input_ids"], out.batch["attention_mask"], mask.shape[1], temperature)
    err = (out.batch["rollout_log_probs"] - ref)[mask].abs()
    print(f"bf16 vLLM vs fp32 HF forward: mean |dlogp| {err.mean():.2e}, max {err.max():.2e}, tokens {int(mask.sum())}")
    assert 0 < err.mean() < 0.1 and err.max() < 1.0

    greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=24))
    lengths = greedy.batch["response_mask"].sum(1).tolist()
    got = [r[:n].tolist() for r, n in zip(greedy.batch["responses"], lengths)]
    expected = hf_greedy(model, PROMPTS, 24)
    agree = [
        next((k for k, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e))) for g, e in zip(got, expected)
    ]
    print(f"bf16 greedy vs fp32 HF greedy: tokens agreeing before the first divergence per prompt: {agree} of 24")
    assert got[0][:1] == expected[0][:1]  # peaked logits: at least the first token survives bf16 rounding
