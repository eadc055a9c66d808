"""VLLMRollout.generate returns base.py's batch layout: B*n rows, masks, padding, stops and seeds."""

from __future__ import annotations

from collections import Counter

import torch
from vllm_test_utils import encode_prompts, hf_model

from hybridflow.engines.rollout.base import SamplingParams

PROMPTS = ["What is 2+3?", "hi", "Name a colour."]


def test_layout_shapes_and_masks(fp32_engine):
    prompts, tok = encode_prompts(PROMPTS)
    n, max_new = 3, 12
    out = fp32_engine.generate(prompts, SamplingParams(temperature=1.0, n=n, max_new_tokens=max_new, seed=7))

    batch, prompt_len = prompts.batch["input_ids"].shape
    rows, resp_len = out.batch["responses"].shape
    assert rows == batch * n and 1 <= resp_len <= max_new
    assert out.batch["prompts"].shape == (rows, prompt_len)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert out.batch[key].shape == (rows, prompt_len + resp_len), key
    assert out.batch["response_mask"].shape == out.batch["rollout_log_probs"].shape == (rows, resp_len)

    for i in range(batch):  # sample j of prompt i at row i*n+j
        for j in range(n):
            assert torch.equal(out.batch["prompts"][i * n + j], prompts.batch["input_ids"][i])
            assert out.non_tensor_batch["uid"][i * n + j] == f"p{i}"
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], out.batch["responses"]], 1))
    mask = out.batch["response_mask"]
    assert torch.equal(out.batch["attention_mask"][:, prompt_len:], mask)
    assert torch.equal(
        out.batch["attention_mask"][:, :prompt_len], prompts.batch["attention_mask"].repeat_interleave(n, 0)
    )
    # Right padding: the mask is 1...1 0...0, padded tokens are pad_token_id, their log-prob 0; real ones are < 0.
    lengths = mask.sum(1)
    assert torch.equal(mask, (torch.arange(resp_len) < lengths[:, None]).to(mask.dtype))
    assert (out.batch["responses"][mask == 0] == tok.pad_token_id).all()
    assert (out.batch["rollout_log_probs"][mask == 0] == 0).all()
    assert (out.batch["rollout_log_probs"][mask == 1] < 0).all()
    # Positions continue from the prompt's last position, one per response token.
    pos = out.batch["position_ids"]
    last_prompt_pos = prompts.batch["position_ids"][:, -1].repeat_interleave(n)
    assert torch.equal(pos[:, prompt_len:], last_prompt_pos[:, None] + torch.arange(1, resp_len + 1))
    # n samples of one prompt are different draws, not copies.
    assert not torch.equal(out.batch["responses"][0], out.batch["responses"][1])


def test_stops_at_eos_and_stop_tokens_including_them(fp32_engine, model_path):
    """Sampling stops right after eos or any stop id, which stays in the response; same seed, same prefix."""
    prompts, tok = encode_prompts(PROMPTS * 8)
    model = hf_model(model_path)
    # Make eos likely: its (tied) embedding becomes 1.3x that of the first greedy token, so eos outscores that token
    # wherever the model favoured it. Loaded through update_weights; the session engine gets model A back after.
    first_greedy = fp32_engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=1)).batch["responses"][0, 0]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    weights["model.embed_tokens.weight"][tok.eos_token_id] = 1.3 * weights["model.embed_tokens.weight"][first_greedy]
    max_new = 24
    try:
        fp32_engine.update_weights(weights.items())
        free = fp32_engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=3))
        free_tokens = response_tokens(free)
        ended_on_eos = [t for t in free_tokens if t[-1] == tok.eos_token_id]
        assert ended_on_eos and all(tok.eos_token_id not in t[:-1] for t in free_tokens)
        assert all(t[-1] == tok.eos_token_id for t in free_tokens if len(t) < max_new)
        # Two tokens that occur mid-response become stop ids; rerun with the same seed.
        counts = Counter(x for t in free_tokens for x in t[:-1])
        stop_ids = [x for x, _ in counts.most_common(2)]
        stopped = fp32_engine.generate(
            prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=stop_ids, seed=3)
        )
    finally:
        fp32_engine.update_weights(model.named_parameters())
    stops = {tok.eos_token_id, *stop_ids}
    expected = [next((t[: k + 1] for k, x in enumerate(t) if x in stops), t) for t in free_tokens]
    assert response_tokens(stopped) == expected
    assert sum(t[-1] in stop_ids for t in expected) > 0  # the stop ids did cut some responses


def response_tokens(out) -> list[list[int]]:
    lengths = out.batch["response_mask"].sum(1).tolist()
    return [r[:n].tolist() for r, n in zip(out.batch["responses"], lengths)]


def test_seeds_make_samples_reproducible(fp32_engine):
    prompts, _ = encode_prompts(PROMPTS)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, n=2, max_new_tokens=10, seed=11)
    first = fp32_engine.generate(prompts, params)
    again = fp32_engine.generate(prompts, params)
    other = fp32_engine.generate(prompts, SamplingParams(**{**vars(params), "seed": 12}))
    assert torch.equal(first.batch["responses"], again.batch["responses"])
    assert torch.equal(first.batch["rollout_log_probs"], again.batch["rollout_log_probs"])
    assert not torch.equal(first.batch["responses"], other.batch["responses"])
    # Unseeded calls draw fresh request seeds from the engine's generator: two calls differ.
    unseeded = SamplingParams(temperature=1.0, n=2, max_new_tokens=10)
    a, b = fp32_engine.generate(prompts, unseeded), fp32_engine.generate(prompts, unseeded)
    assert not torch.equal(a.batch["responses"], b.batch["responses"])


def test_greedy_ignores_seed_and_is_deterministic(fp32_engine):
    prompts, _ = encode_prompts(PROMPTS)
    a = fp32_engine.generate(prompts, SamplingParams(greedy=True, n=2, max_new_tokens=10, seed=1))
    b = fp32_engine.generate(prompts, SamplingParams(greedy=True, n=2, max_new_tokens=10, seed=2))
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.equal(a.batch["responses"][0::2], a.batch["responses"][1::2])  # n greedy copies agree
