"""A batch whose prompts exceed one scheduler step's token budget, with seeds (regression: CPU chunked prefill)."""

from __future__ import annotations

from vllm_test_utils import encode_prompts

from hybridflow.engines.rollout.base import SamplingParams


def test_many_long_prompts_with_seeds(fp32_engine):
    # 320 prompts x ~40 tokens = ~12.8k prompt tokens: more than one step's budget, so some prompts wait or split.
    texts = [f"prompt number {i}: " + "abcdefghij" * 2 for i in range(320)]
    prompts, _ = encode_prompts(texts)
    out = fp32_engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=2, seed=0))
    assert out.batch["responses"].shape[0] == 320
    assert (out.batch["response_mask"].sum(1) >= 1).all()
