"""RewardManager: batch scoring in worker processes, the failure-score path, timeouts, the failure-fraction stop."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from hybridflow.engines.tiny import build_char_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import (
    RewardComputationError,
    RewardConfigError,
    RewardManager,
    load_custom_reward_fn,
)

FNS = os.path.join(os.path.dirname(__file__), "custom_reward_fns.py")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def make_batch(tokenizer, responses, truths, data_source="hybridflow/arithmetic", *, in_reward_model=False, **tensors):
    """Responses right-padded with pad, eos appended, response_mask over the tokens and eos (the rollout layout)."""
    encoded = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in responses]
    width = max(len(e) for e in encoded) + 2
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    sources = data_source if isinstance(data_source, list) else [data_source] * len(responses)
    non_tensors = {"data_source": sources, "extra_info": [{"index": i} for i in range(len(responses))]}
    if in_reward_model:
        non_tensors["reward_model"] = [{"style": "rule", "ground_truth": t} for t in truths]
    else:
        non_tensors["ground_truth"] = list(truths)
    return DataProto.from_dict({"responses": ids, "response_mask": mask, **tensors}, non_tensors)


def test_builtin_scores_placed_on_last_response_token(tokenizer):
    responses = ["1+2=3\n#### 3", "#### 4", "#### 12", "x\n#### 5,000"]
    batch = make_batch(
        tokenizer, responses, ["3", "3", "12", "5000"],
        ["hybridflow/arithmetic"] * 3 + ["openai/gsm8k"], in_reward_model=True,
    )
    with RewardManager(tokenizer, num_workers=2) as rm:
        result = rm(batch)
        again = rm(batch)  # the warm pool scores the same way
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 1.0] == again.scores.tolist()
    assert result.responses_text == responses  # eos and padding skipped
    tls = result.token_level_scores
    assert tls.dtype == torch.float32 and tls.shape == batch.batch["responses"].shape
    last = batch.batch["response_mask"].sum(-1) - 1
    for i in range(4):
        assert tls[i, last[i]] == result.scores[i] and tls[i].sum() == result.scores[i]
    assert result.metrics["reward/failures"] == 0 and result.metrics["reward/score_mean"] == 0.75


def test_custom_function_extras_rm_scores_and_in_process_mode(tokenizer):
    fn = load_custom_reward_fn(f"{FNS}:misbehaving")
    batch = make_batch(tokenizer, ["abcdef", "zz"], ["dict", "ok"], "custom", rm_scores=torch.tensor([0.5, -1.0]))
    for workers in (1, 0):
        with RewardManager(tokenizer, fn, num_workers=workers, rm_score_weight=2.0) as rm:
            result = rm(batch)
        assert result.rule_scores.tolist() == [0.5, 1.0]
        assert result.scores.tolist() == [1.5, -1.0]
        assert result.extra == {"acc": [1.0, None], "pred": ["abc", None]}
        assert result.metrics["reward/rm_score_mean"] == -0.25


def test_failures_get_failure_score_are_counted_and_logged_once(tokenizer, caplog):
    fn = load_custom_reward_fn(f"{FNS}:misbehaving")
    kinds = ["raise", "none", "nan", "inf", "string", "tuple", "dict_without_score", "exit", "hang"]
    truths = [*kinds, "raise"] + ["ok"] * 10
    batch = make_batch(tokenizer, ["a"] * len(truths), truths, "custom")
    with (
        caplog.at_level(logging.WARNING, logger="hybridflow.rewards.manager"),
        RewardManager(tokenizer, fn, num_workers=2, timeout_s=1.0, failure_score=-1.0) as rm,
    ):
        result = rm(batch)
        # The run continues: the killed workers were replaced and score the next batch.
        follow_up = rm(make_batch(tokenizer, ["b"] * 4, ["ok"] * 4, "custom"))
    assert result.scores[:10].tolist() == [-1.0] * 10 and result.scores[10:].tolist() == [1.0] * 10
    assert result.failed.tolist() == [True] * 10 + [False] * 10
    m = result.metrics
    assert (m["reward/raised"], m["reward/invalid"], m["reward/crashed"], m["reward/timeouts"]) == (2, 6, 1, 1)
    assert m["reward/failures"] == 10 and m["reward/failure_fraction"] == 0.5
    assert follow_up.scores.tolist() == [1.0] * 4 and follow_up.metrics["reward/failures"] == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4  # once per kind (raised, invalid, crashed, timeout) for this data_source
    raised = next(msg for msg in messages if "reward raised" in msg)
    assert "'custom'" in raised and "row 0" in raised and "KeyError" in raised
    assert any("timeout" in msg and "row 8" in msg and "1s" in msg for msg in messages)
    assert any("returned None" in msg for msg in messages)


def test_too_many_failures_stop_with_a_clear_error(tokenizer):
    fn = load_custom_reward_fn(f"{FNS}:misbehaving")
    batch = make_batch(tokenizer, ["a"] * 4, ["none", "none", "ok", "none"], "custom")
    expected = r"3 of 4 samples could not be scored \(invalid: 3\)"
    with RewardManager(tokenizer, fn, num_workers=1, max_failure_fraction=0.5) as rm, pytest.raises(
        RewardComputationError, match=expected
    ) as e:
        rm(batch)
    assert "row 0" in str(e.value) and "returned None" in str(e.value) and "max_failure_fraction" in str(e.value)


def test_config_errors(tokenizer):
    with pytest.raises(RewardConfigError, match="cannot be pickled"):
        RewardManager(tokenizer, lambda **kw: 1.0, num_workers=1)
    with pytest.raises(RewardConfigError, match="timeout_s must be > 0"):
        RewardManager(tokenizer, timeout_s=0)
    rm = RewardManager(tokenizer, num_workers=0)
    batch = make_batch(tokenizer, ["x"], ["1"])
    batch.pop(non_tensor_keys=["ground_truth"])
    with pytest.raises(RewardConfigError, match="neither 'ground_truth' nor 'reward_model'"):
        rm(batch)
    unknown = make_batch(tokenizer, ["x"], ["1"], "no/such-source")
    with pytest.raises(RewardConfigError, match=r"no reward function for data_source 'no/such-source'"):
        rm(unknown)


def test_worker_killed_between_batches_is_replaced(tokenizer):
    fn = load_custom_reward_fn(f"{FNS}:exact")
    batch = make_batch(tokenizer, ["7", "8"], ["7", "7"], "custom")
    with RewardManager(tokenizer, fn, num_workers=1) as rm:
        assert rm(batch).scores.tolist() == [1.0, 0.0]
        victim = rm._pool._workers[0].process
        victim.kill()  # as the OOM killer would
        victim.wait()
        assert rm(batch).scores.tolist() == [1.0, 0.0]
        assert rm._pool._workers[0].process.pid != victim.pid
