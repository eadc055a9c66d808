"""Prefill under a token budget (engines/rollout/chunked_prefill.py, veRL's enable_chunked_prefill /
max_num_batched_tokens): the prefill really runs in groups within the budget, and the generated tokens and
log-probs are those of the one-shot prefill (eager and fixed-shape decode), greedy == hf."""

from __future__ import annotations

import pytest
import torch
from test_rollout_engines import make_prompts, write_model

import hybridflow.engines.rollout.chunked_prefill as chunked_prefill_module
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.engines.rollout.chunked_prefill import prefill_groups
from hybridflow.trainer.config import ConfigError, load_config


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("qwen2_chunked"), "qwen2", seed=0)


def test_groups_cover_the_rows_within_the_budget():
    assert prefill_groups(6, 10, None) == [(0, 6)] and prefill_groups(6, 10, 60) == [(0, 6)]
    assert prefill_groups(6, 10, 25) == [(0, 2), (2, 4), (4, 6)]
    assert prefill_groups(5, 10, 30) == [(0, 3), (3, 5)]
    assert prefill_groups(3, 10, 4) == [(0, 1), (1, 2), (2, 3)]  # a prompt longer than the budget: alone


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_budgeted_prefill_gives_the_same_generation(qwen_path, decode, monkeypatch):
    whole = create_rollout_engine("native", qwen_path, num_threads=1, decode=decode)
    budget = create_rollout_engine("native", qwen_path, num_threads=1, decode=decode, max_num_batched_tokens=20)
    prompts = make_prompts(whole.tokenizer)
    B, P = prompts.batch["input_ids"].shape
    assert B * P > 20  # the budget really splits this batch

    calls = []
    original = chunked_prefill_module.packed_prefill  # each group's prefill (without its padding: packed_prefill.py)

    def spy(model, ids, *args):
        if model is budget.model:
            calls.append(tuple(ids.shape))
        return original(model, ids, *args)

    monkeypatch.setattr(chunked_prefill_module, "packed_prefill", spy)
    for params in (SamplingParams(greedy=True, max_new_tokens=12),
                   SamplingParams(temperature=1.0, n=3, max_new_tokens=10, seed=5)):
        calls.clear()
        want, got = whole.generate(prompts, params), budget.generate(prompts, params)
        assert torch.equal(got.batch["responses"], want.batch["responses"])
        assert torch.equal(got.batch["response_mask"], want.batch["response_mask"])
        assert float((got.batch["rollout_log_probs"] - want.batch["rollout_log_probs"]).abs().max()) <= 1e-5
        assert len(calls) == len(prefill_groups(B, P, 20)) > 1
        assert sum(rows for rows, _ in calls) == B and all(rows * width <= max(20, width) for rows, width in calls)
    hf = create_rollout_engine("hf", qwen_path).generate(prompts, SamplingParams(greedy=True, max_new_tokens=12))
    got = budget.generate(prompts, SamplingParams(greedy=True, max_new_tokens=12))
    assert torch.equal(got.batch["responses"], hf.batch["responses"])


def test_config_keys_reach_the_native_engine_and_are_refused_elsewhere():
    from hybridflow.engines.rollout.registry import rollout_engine_kwargs

    def rollout(*overrides):
        return load_config(list(overrides)).actor_rollout_ref.rollout

    assert rollout_engine_kwargs(rollout("actor_rollout_ref.rollout.enable_chunked_prefill=true")) == {
        "max_num_batched_tokens": 8192}
    assert rollout_engine_kwargs(rollout("actor_rollout_ref.rollout.enable_chunked_prefill=true",
                                         "actor_rollout_ref.rollout.max_num_batched_tokens=512")) == {
        "max_num_batched_tokens": 512}
    assert rollout_engine_kwargs(rollout("actor_rollout_ref.rollout.enable_chunked_prefill=false")) == {}
    with pytest.raises(ConfigError, match="max_num_batched_tokens=0: give a positive"):
        load_config(["actor_rollout_ref.rollout.max_num_batched_tokens=0"])
    with pytest.raises(ConfigError, match=r"enable_chunked_prefill has no effect with actor_rollout_ref\.rollout\.name=hf"):
        load_config(["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.enable_chunked_prefill=true"])
