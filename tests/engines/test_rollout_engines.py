"""Rollout engines against transformers: greedy native == hf, the output layout, log-probs vs a plain forward pass,
weight updates, and the train-inference mismatch number."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.engines.tiny import SIZES, build_char_tokenizer, make_config
from hybridflow.protocol import DataProto

PROMPTS = ["hello world", "a", "the quick brown fox jumps", "xyz 123", "RL!", "policy gradient"]


def write_model(path, arch: str = "qwen2", seed: int = 0, tie: bool = True) -> str:
    """A unit-size model with a wide weight init (std 0.3), so greedy outputs vary instead of repeating one token.

    Biases and norm weights are randomised too: a backend that dropped them would decode differently.
    """
    tokenizer = build_char_tokenizer()
    config = make_config(dataclasses.replace(SIZES["unit"], arch=arch, tie_word_embeddings=tie), tokenizer)
    config.initializer_range = 0.3
    if arch == "llama":
        config.attention_bias = True
        config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_prompts(tokenizer, texts=PROMPTS) -> DataProto:
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, padding_side="left")
    mask = enc["attention_mask"]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": mask, "position_ids": position_ids},
        {"uid": list(range(len(texts)))},
        {"step": 3},
    )


def add_generation_eos(path: str, extra_eos: int) -> None:
    """Declare a second eos id in generation_config.json (as chat checkpoints do)."""
    tokenizer = build_char_tokenizer()
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, extra_eos], pad_token_id=tokenizer.pad_token_id).save_pretrained(path)


def frequent_mid_token(responses: torch.Tensor) -> int:
    """A token that greedy decoding emits after the first position in some rows but not in all."""
    counts = torch.bincount(responses[:, 2:].flatten())
    for token in counts.argsort(descending=True).tolist():
        rows_with = (responses[:, 2:] == token).any(-1)
        if 0 < int(rows_with.sum()) < responses.shape[0]:
            return token
    raise AssertionError("no token distinguishes the rows; the test model is degenerate")


def forward_log_probs(model_path: str, out: DataProto, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of a plain HF forward over the rollout output, at the response tokens [B, R]."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits.float()
    R = out.batch["responses"].shape[1]
    P = out.batch["prompts"].shape[1]
    step_logits = logits[:, P - 1 : P - 1 + R] / temperature
    return torch.log_softmax(step_logits, -1).gather(-1, out.batch["responses"][..., None]).squeeze(-1)


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("qwen2_rollout"), "qwen2", seed=0)


@pytest.fixture(scope="module")
def engines(qwen_path):
    return {name: create_rollout_engine(name, qwen_path, num_threads=1) for name in ("hf", "native")}


@pytest.mark.parametrize("arch,tie", [("qwen2", True), ("llama", False)])
def test_greedy_native_equals_hf(tmp_path, arch, tie):
    path = write_model(tmp_path / arch, arch, seed=1, tie=tie)
    prompts = make_prompts(build_char_tokenizer())
    plain = create_rollout_engine("hf", path).generate(prompts, SamplingParams(greedy=True, max_new_tokens=20))
    # Make rows stop at different steps: one eos from generation_config.json, one from params.stop_token_ids.
    eos_token = frequent_mid_token(plain.batch["responses"])
    add_generation_eos(path, eos_token)
    without_eos = plain.batch["responses"].masked_fill(plain.batch["responses"] == eos_token, -1)
    stop_token = frequent_mid_token(without_eos.clamp(min=0))
    params = SamplingParams(greedy=True, n=2, max_new_tokens=20, stop_token_ids=[stop_token])

    hf = create_rollout_engine("hf", path, num_threads=1).generate(prompts, params)
    native = create_rollout_engine("native", path, num_threads=1).generate(prompts, params)

    lengths = hf.batch["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1, "rows should stop at different steps for this test to mean anything"
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(hf.batch[key], native.batch[key]), key
    # 1e-5 absolute on CPU; GPU kernels round differently, so 1e-5 relative on top (seen 1.8e-5 at |log p| = 1.8)
    torch.testing.assert_close(native.batch["rollout_log_probs"], hf.batch["rollout_log_probs"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["hf", "native"])
def test_output_layout(engines, name):
    tokenizer = engines[name].tokenizer
    prompts = make_prompts(tokenizer)
    B, P, n, max_new = len(PROMPTS), prompts.batch["input_ids"].shape[1], 3, 12
    stop = [int(t) for t in tokenizer.convert_tokens_to_ids(list("aeiou"))]
    out = engines[name].generate(prompts, SamplingParams(temperature=1.0, n=n, max_new_tokens=max_new, seed=5, stop_token_ids=stop))

    R = out.batch["responses"].shape[1]
    assert len(out) == B * n and max_new >= R
    for key, width in [("prompts", P), ("input_ids", P + R), ("attention_mask", P + R), ("position_ids", P + R),
                       ("response_mask", R), ("rollout_log_probs", R)]:
        assert out.batch[key].shape == (B * n, width), key
    # sample j of prompt i sits at row i * n + j, with its prompt's non-tensor columns and the batch meta_info
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(n, 0))
    assert out.non_tensor_batch["uid"].tolist() == [i for i in range(B) for _ in range(n)]
    assert out.meta_info == {"step": 3}
    responses, mask = out.batch["responses"], out.batch["response_mask"]
    lengths = mask.sum(-1)
    assert int(lengths.max()) == R and torch.equal(mask, (torch.arange(R)[None] < lengths[:, None]).long())
    stop_ids = torch.tensor([*stop, tokenizer.eos_token_id])
    for row in range(B * n):
        length = int(lengths[row])
        body = responses[row, : length - 1]
        assert not torch.isin(body, stop_ids).any(), "generation must stop at the first stop token"
        if length < max_new:  # stopped early: the stop token itself is part of the response
            assert int(responses[row, length - 1]) in stop_ids.tolist()
        assert (responses[row, length:] == engines[name].pad_token_id).all()
    assert (out.batch["rollout_log_probs"][mask == 0] == 0).all()
    assert (out.batch["rollout_log_probs"][mask == 1] <= 0).all()
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], responses], 1))
    prompt_mask = prompts.batch["attention_mask"].repeat_interleave(n, 0)
    assert torch.equal(out.batch["attention_mask"], torch.cat([prompt_mask, mask], 1))
    last_pos = prompts.batch["position_ids"][:, -1].repeat_interleave(n)
    assert torch.equal(out.batch["position_ids"][:, P:], last_pos[:, None] + 1 + torch.arange(R)[None])


@pytest.mark.parametrize("name", ["hf", "native"])
def test_rollout_log_probs_match_a_forward_pass(engines, qwen_path, name):
    temperature = 0.7
    params = SamplingParams(temperature=temperature, top_k=50, top_p=0.9, n=2, max_new_tokens=16, seed=11)
    out = engines[name].generate(make_prompts(engines[name].tokenizer), params)
    train = forward_log_probs(qwen_path, out, temperature)
    stats = logprob_mismatch(out.batch["rollout_log_probs"], train, out.batch["response_mask"])
    assert stats["mismatch/mean_abs"] <= 1e-5, stats
    assert stats["mismatch/max_abs"] <= 1e-4, stats


@pytest.mark.parametrize("n", [1, 4])
def test_shared_prompt_kv_when_samples_finish_at_different_steps(engines, qwen_path, n):
    """Each prompt's K/V is stored once for its n samples. When some of a prompt's samples stop (vowels are stop
    tokens here) the running rows are compacted and regrouped; every later token must still see exactly its own
    prompt and its own earlier tokens, so its log-prob equals a plain forward pass."""
    tokenizer = engines["native"].tokenizer
    stop = [int(t) for t in tokenizer.convert_tokens_to_ids(list("aeiou"))]
    params = SamplingParams(temperature=1.0, n=n, max_new_tokens=16, seed=3, stop_token_ids=stop)
    out = engines["native"].generate(make_prompts(tokenizer), params)
    lengths = out.batch["response_mask"].sum(-1).view(len(PROMPTS), n)
    assert int(lengths.max()) > 4 and int(lengths.min()) < int(lengths.max()), "rows must stop at different steps"
    if n > 1:
        assert (lengths.min(1).values < lengths.max(1).values).any(), "some prompt's samples must stop apart"
    train = forward_log_probs(qwen_path, out, 1.0)
    stats = logprob_mismatch(out.batch["rollout_log_probs"], train, out.batch["response_mask"])
    assert stats["mismatch/max_abs"] <= 1e-4 and stats["mismatch/mean_abs"] <= 1e-5, stats


def test_bf16_native_mismatch_is_reported_and_small(qwen_path):
    engine = create_rollout_engine("native", qwen_path, dtype="bf16", num_threads=1)
    out = engine.generate(make_prompts(engine.tokenizer), SamplingParams(n=2, max_new_tokens=16, seed=2))
    stats = logprob_mismatch(out.batch["rollout_log_probs"], forward_log_probs(qwen_path, out, 1.0),
                             out.batch["response_mask"])
    print("bf16 native vs fp32 forward:", stats)
    # bf16 has 8 mantissa bits: a per-token error of a few 1e-2 is expected; an error of order 1 would be a bug.
    assert 0 < stats["mismatch/mean_abs"] < 0.1, stats
    assert stats["mismatch/kl"] >= 0


@pytest.mark.parametrize("name", ["hf", "native"])
def test_update_weights_switches_to_the_other_model(engines, qwen_path, tmp_path, name):
    other_path = write_model(tmp_path / "other", "qwen2", seed=7)
    prompts = make_prompts(engines[name].tokenizer)
    params = SamplingParams(greedy=True, max_new_tokens=12)
    reference = create_rollout_engine("hf", other_path).generate(prompts, params)
    before = engines[name].generate(prompts, params)
    assert not torch.equal(before.batch["responses"], reference.batch["responses"])

    other = AutoModelForCausalLM.from_pretrained(other_path)
    engines[name].update_weights((k, v) for k, v in other.state_dict().items())
    after = engines[name].generate(prompts, params)
    assert torch.equal(after.batch["responses"], reference.batch["responses"])
    torch.testing.assert_close(after.batch["rollout_log_probs"], reference.batch["rollout_log_probs"], atol=1e-5, rtol=0)

    original = AutoModelForCausalLM.from_pretrained(qwen_path)  # restore for later tests
    engines[name].update_weights(original.state_dict().items())
    assert torch.equal(engines[name].generate(prompts, params).batch["responses"], before.batch["responses"])


def test_update_weights_rejects_unknown_names_and_shapes(engines):
    with pytest.raises(KeyError, match="unknown parameter"):
        engines["native"].update_weights([("model.layers.0.self_attn.qq_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engines["native"].update_weights([("model.norm.weight", torch.zeros(3))])


def test_max_new_tokens_and_max_model_len(qwen_path):
    prompts = make_prompts(build_char_tokenizer())
    P = prompts.batch["input_ids"].shape[1]
    for name in ("hf", "native"):
        engine = create_rollout_engine(name, qwen_path, max_model_len=P + 5, num_threads=1)
        out = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=9))
        assert out.batch["responses"].shape[1] <= 5, name  # max_model_len caps max_new_tokens
        with pytest.raises(ValueError, match="max_model_len"):
            create_rollout_engine(name, qwen_path, max_model_len=P).generate(prompts, SamplingParams(greedy=True))


def test_prompts_must_be_left_padded(engines):
    prompts = make_prompts(engines["native"].tokenizer)
    prompts.batch["attention_mask"] = prompts.batch["attention_mask"].flip(-1)
    with pytest.raises(ValueError, match="left-padded"):
        engines["native"].generate(prompts, SamplingParams(greedy=True))
