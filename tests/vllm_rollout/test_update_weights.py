"""update_weights swaps the policy in place, and the prefix cache does not serve KV computed with the old weights."""

from __future__ import annotations

from vllm_test_utils import encode_prompts, hf_greedy, hf_model

from hybridflow.engines.rollout.base import SamplingParams

# ~430 tokens: many full KV blocks, so a second request with this prompt is a prefix-cache hit.
LONG_PROMPT = "In RL from feedback, the policy generates and the reward model scores each response. " * 5
TEXTS = ["hello there", LONG_PROMPT]


def greedy(engine, max_new_tokens=12) -> list[list[int]]:
    prompts, _ = encode_prompts(TEXTS)
    out = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=max_new_tokens))
    lengths = out.batch["response_mask"].sum(1).tolist()
    return [r[:n].tolist() for r, n in zip(out.batch["responses"], lengths)]


def test_update_weights_then_outputs_follow_new_model(fp32_engine, model_path, other_model_path):
    """named_parameters() of a tied-embedding model omits lm_head.weight: update_weights must cope with that too."""
    model_a, model_b = hf_model(model_path), hf_model(other_model_path)
    expected_a, expected_b = hf_greedy(model_a, TEXTS, 12), hf_greedy(model_b, TEXTS, 12)
    assert expected_a != expected_b, "the two models give the same outputs: the test could not tell them apart"
    try:
        assert greedy(fp32_engine) == expected_a  # also fills the prefix cache with model A's KV for LONG_PROMPT
        fp32_engine.update_weights(model_b.named_parameters())
        print(f"update_weights (tiny model, fp32): {fp32_engine.last_update_seconds:.3f} s")
        assert greedy(fp32_engine) == expected_b  # LONG_PROMPT included: the cached KV of model A was dropped

        # Teeth: reload without the reset and vLLM does serve LONG_PROMPT's prefix from the cache (model B's KV),
        # which is why update_weights must reset it.
        raw_reload = {"weights_iterator": iter(model_a.state_dict().items())}  # state_dict lists the tied lm_head too
        fp32_engine.llm.collective_rpc("reload_weights", kwargs=raw_reload)
        stale = greedy(fp32_engine)
        assert stale[1] != expected_a[1], "vLLM recomputed the cached prefix; this test cannot see a missing reset"
        assert fp32_engine.llm.reset_prefix_cache()
        assert greedy(fp32_engine) == expected_a
    finally:
        fp32_engine.update_weights(model_a.named_parameters())  # the session engine goes back to model A
    assert greedy(fp32_engine) == expected_a


def test_update_weights_accepts_other_dtypes(fp32_engine, model_path):
    """The trainer may hand over bf16 shards; they are cast on load (the outputs need not match, only work)."""
    model_a = hf_model(model_path)
    bf16 = [(name, p.detach().to("cpu").bfloat16()) for name, p in model_a.named_parameters()]
    try:
        fp32_engine.update_weights(bf16)
        assert all(len(tokens) > 0 for tokens in greedy(fp32_engine, max_new_tokens=4))
    finally:
        fp32_engine.update_weights(model_a.named_parameters())
