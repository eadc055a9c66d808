"""An fp32 vLLM engine agrees with transformers: greedy tokens, and log-probs at temperature T (not raw logits)."""

from __future__ import annotations

import logging

from vllm_test_utils import encode_prompts, hf_greedy, hf_model, hf_token_log_probs

from hybridflow.engines.rollout.base import SamplingParams

PROMPTS = ["The quick brown fox", "1+1=", "Once upon a time, in a land far away,"]


def vllm_tokens(out) -> list[list[int]]:
    lengths = out.batch["response_mask"].sum(1).tolist()
    return [r[:n].tolist() for r, n in zip(out.batch["responses"], lengths)]


def test_greedy_matches_hf_generate_token_for_token(fp32_engine, model_path):
    prompts, _ = encode_prompts(PROMPTS)
    out = fp32_engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=24))
    assert vllm_tokens(out) == hf_greedy(hf_model(model_path), PROMPTS, 24)


def test_log_probs_are_temperature_scaled_and_match_hf_forward(fp32_engine, model_path):
    """rollout_log_probs == log_softmax(logits / T) of an HF forward over the same tokens (the training side)."""
    prompts, _ = encode_prompts(PROMPTS)
    temperature = 0.6
    out = fp32_engine.generate(prompts, SamplingParams(temperature=temperature, n=2, max_new_tokens=16, seed=5))
    mask = out.batch["response_mask"].bool()
    resp_len = mask.shape[1]
    model = hf_model(model_path)
    ref = hf_token_log_probs(model, out.batch["input_ids"], out.batch["attention_mask"], resp_len, temperature)
    raw = hf_token_log_probs(model, out.batch["input_ids"], out.batch["attention_mask"], resp_len, 1.0)
    got = out.batch["rollout_log_probs"]
    err = (got - ref)[mask].abs()
    print(f"fp32 vLLM vs HF fp32 forward, T={temperature}: mean |dlogp| {err.mean():.2e}, max {err.max():.2e}")
    assert err.max() < 1e-3
    # The same tokens' raw (T=1) log-probs are far off: the check above can tell the two semantics apart.
    assert (got - raw)[mask].abs().mean() > 0.1


def test_greedy_log_probs_are_at_temperature_one(fp32_engine, model_path):
    prompts, _ = encode_prompts(PROMPTS)
    out = fp32_engine.generate(prompts, SamplingParams(greedy=True, temperature=0.3, max_new_tokens=8))
    mask = out.batch["response_mask"].bool()
    ref = hf_token_log_probs(
        hf_model(model_path), out.batch["input_ids"], out.batch["attention_mask"], mask.shape[1], 1.0
    )
    assert (out.batch["rollout_log_probs"] - ref)[mask].abs().max() < 1e-3


def test_top_k_top_p_log_probs_are_flagged_as_renormalised(fp32_engine, model_path, caplog):
    """With top-k, vLLM's log-probs are over the kept tokens (>= full-vocab values): generate says so in a warning."""
    prompts, _ = encode_prompts(PROMPTS)
    fp32_engine._warned_filtered_log_probs = False  # the warning is once per engine
    with caplog.at_level(logging.WARNING, logger="hybridflow.engines.rollout.vllm_rollout"):
        out = fp32_engine.generate(prompts, SamplingParams(temperature=1.0, top_k=5, max_new_tokens=8, seed=0))
    assert "renormalised" in caplog.text
    mask = out.batch["response_mask"].bool()
    ref = hf_token_log_probs(
        hf_model(model_path), out.batch["input_ids"], out.batch["attention_mask"], mask.shape[1], 1.0
    )
    assert ((out.batch["rollout_log_probs"] - ref)[mask] > -1e-4).all()  # renormalised over 5 tokens: never lower
