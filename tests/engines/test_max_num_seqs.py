"""veRL's rollout.max_num_seqs on the native engine: no decode batch holds more rows than the cap (prompts go in
successive groups), and the samples are those of one uncapped call, row for row."""

from __future__ import annotations

import pytest
import torch
from test_rollout_engines import make_prompts, write_model

import hybridflow.engines.rollout.chunked_prefill as chunked_prefill_module
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.protocol import DataProto
from hybridflow.trainer.config import ConfigError, load_config


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("qwen2_max_num_seqs"), "qwen2", seed=0)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_capped_decode_batches_give_the_same_samples(qwen_path, decode, monkeypatch):
    whole = create_rollout_engine("native", qwen_path, num_threads=1, decode=decode)
    capped = create_rollout_engine("native", qwen_path, num_threads=1, decode=decode, max_num_seqs=4)
    prompts = make_prompts(whole.tokenizer)
    B = len(prompts)
    widths = []
    original = chunked_prefill_module.packed_prefill  # each decode batch's prefill (packed_prefill.py)

    def spy(model, ids, *args):
        if model is capped.model:
            widths.append(ids.shape[0])
        return original(model, ids, *args)

    monkeypatch.setattr(chunked_prefill_module, "packed_prefill", spy)
    for params in (SamplingParams(greedy=True, max_new_tokens=12),
                   SamplingParams(temperature=1.0, n=3, max_new_tokens=10, seed=5)):
        widths.clear()
        want, got = whole.generate(prompts, params), capped.generate(prompts, params)
        assert B * params.n > 4  # the cap really splits this call
        per = 4 // params.n  # prompts per decode batch
        assert widths == [min(per, B - lo) for lo in range(0, B, per)]  # every batch within the cap, all prompts once
        assert got.batch["responses"].shape == want.batch["responses"].shape
        assert torch.equal(got.batch["responses"], want.batch["responses"])
        assert torch.equal(got.batch["attention_mask"], want.batch["attention_mask"])
        # fp32 sums in another order for another batch shape: equal up to rounding
        assert float((got.batch["rollout_log_probs"] - want.batch["rollout_log_probs"]).abs().max()) <= 5e-5


def test_unseeded_calls_draw_one_seed_per_call(qwen_path):
    a = create_rollout_engine("native", qwen_path, num_threads=1, seed=3)
    b = create_rollout_engine("native", qwen_path, num_threads=1, seed=3, max_num_seqs=4)
    prompts = make_prompts(a.tokenizer)
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=8)
    for _ in range(2):  # the engines' seed streams stay in step across calls
        assert torch.equal(a.generate(prompts, params).batch["responses"], b.generate(prompts, params).batch["responses"])
    assert isinstance(b.generate(prompts, params), DataProto)


def test_the_key_reaches_native_and_vllm_and_is_checked():
    from hybridflow.engines.rollout.registry import rollout_engine_kwargs

    rollout = load_config(["actor_rollout_ref.rollout.max_num_seqs=64"]).actor_rollout_ref.rollout
    assert rollout_engine_kwargs(rollout) == {"max_num_seqs": 64}
    with pytest.raises(ConfigError, match=r"max_num_seqs=2 is below actor_rollout_ref\.rollout\.n=4"):
        load_config(["actor_rollout_ref.rollout.max_num_seqs=2", "actor_rollout_ref.rollout.n=4"])
    with pytest.raises(ConfigError, match=r"max_num_seqs has no effect with actor_rollout_ref\.rollout\.name=hf"):
        load_config(["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.max_num_seqs=8"])


def test_vllm_gets_its_own_max_num_seqs():
    pytest.importorskip("vllm")  # the vLLM environment (.venv-vllm); the native engine's tests above run everywhere
    from hybridflow.engines.rollout.vllm_rollout import VLLMRollout

    rollout = load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.max_num_seqs=64"]
                          ).actor_rollout_ref.rollout
    assert VLLMRollout.options_from_config(rollout)["max_num_seqs"] == 64
