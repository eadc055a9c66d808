"""Reward managers by veRL's names: naive, batch (one call per batch), dapo (overlong penalty, acc), prime."""

from __future__ import annotations

import os

import pytest
import torch
from test_reward_manager import make_batch

from hybridflow.engines.tiny import build_char_tokenizer
from hybridflow.rewards import (
    BatchRewardManager,
    OverlongShaping,
    PrimeRewardManager,
    RewardComputationError,
    RewardConfigError,
    RewardManager,
    RewardManagerSpec,
    available_reward_managers,
    build_reward_manager,
)
from hybridflow.trainer.config import ConfigError, load_config

FNS = os.path.join(os.path.dirname(__file__), "custom_reward_fns.py")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def spec(**kw) -> RewardManagerSpec:
    kw.setdefault("options", {"num_workers": 0})
    return RewardManagerSpec(**kw)


def test_registry_names_and_config_errors():
    assert {"naive", "batch", "dapo", "prime"} <= set(available_reward_managers())
    tok = build_char_tokenizer()
    with pytest.raises(RewardConfigError, match=r"unknown reward manager .nope.; known: .*batch, dapo, naive, prime"):
        build_reward_manager("nope", tok, spec())
    with pytest.raises(RewardConfigError, match=r"'naive' reward manager takes none.*reward_manager=dapo"):
        build_reward_manager("naive", tok, spec(reward_kwargs={"overlong_buffer_cfg": {"enable": True}}))
    with pytest.raises(RewardConfigError, match=r"set custom_reward_function\.path"):
        build_reward_manager("batch", tok, spec())
    with pytest.raises(RewardConfigError, match=r"custom_reward_function\.reward_kwargs is set but"):
        build_reward_manager("naive", tok, spec(custom_kwargs={"x": 1}))
    with pytest.raises(RewardConfigError, match=r"overlong_buffer_cfg.\['lenght'\]: unknown"):
        build_reward_manager("dapo", tok, spec(reward_kwargs={"overlong_buffer_cfg": {"lenght": 4}}))


def test_a_manager_plugin_by_import_path(tokenizer):
    batch = make_batch(tokenizer, ["abc", "a"], ["?", "?"])
    with build_reward_manager(f"{FNS}:length_manager", tokenizer, spec(reward_kwargs={"anything": 1})) as rm:
        assert rm(batch).scores.tolist() == [3.0, 1.0]


def test_batch_manager_calls_once_per_batch_with_reward_kwargs(tokenizer):
    batch = make_batch(tokenizer, ["7", "8", "x", "9"], ["7", "8", "9", "9"], ["a", "a", "b", "b"],
                       in_reward_model=True)
    for workers in (1, 0):
        rm = build_reward_manager("batch", tokenizer, spec(
            custom_path=FNS, custom_name="batch_exact", reward_kwargs={"bonus": 0.5, "scale": 3.0},
            custom_kwargs={"scale": 2.0},  # the custom function's own kwargs win over reward_model's (as in veRL)
            options={"num_workers": workers},
        ))
        assert isinstance(rm, BatchRewardManager)
        with rm:
            result = rm(batch)
        assert result.scores.tolist() == [2.5, 2.5, 0.5, 2.5]
        assert result.extra["batch_size"] == [4, 4, 4, 4]  # one call saw the whole batch
        assert result.extra["ds"] == ["a", "a", "b", "b"]
        assert result.extra["acc"] == [2.5, 2.5, 0.5, 2.5]  # veRL's batch manager: acc = each row's score


def test_batch_manager_wrong_result_fails_every_row(tokenizer):
    batch = make_batch(tokenizer, ["7", "8"], ["7", "8"])
    with build_reward_manager("batch", tokenizer, spec(custom_path=FNS, custom_name="batch_wrong_length")) as rm, \
            pytest.raises(RewardComputationError, match="returned 1 scores for a batch of 2 rows"):
        rm(batch)


def test_batch_manager_refuses_a_per_sample_function(tokenizer):
    with pytest.raises(RewardConfigError, match=r"per-batch reward function.*missing.*reward_manager=naive"):
        build_reward_manager("batch", tokenizer, spec(custom_path=FNS, custom_name="exact"))
    with pytest.raises(RewardConfigError, match=r"per-sample.*reward_manager=batch"):
        build_reward_manager("naive", tokenizer, spec(custom_path=FNS, custom_name="batch_exact"))


def test_custom_reward_kwargs_reach_a_per_sample_function(tokenizer):
    batch = make_batch(tokenizer, ["abc", "a"], ["?", "?"])
    with build_reward_manager("naive", tokenizer, spec(custom_path=FNS, custom_name="needs_kwarg",
                                                       custom_kwargs={"threshold": 2})) as rm:
        assert rm(batch).scores.tolist() == [1.0, 0.0]
    with pytest.raises(RewardConfigError, match="unexpected required"):  # the function needs a kwarg not given
        build_reward_manager("naive", tokenizer, spec(custom_path=FNS, custom_name="needs_kwarg"))


def verl_dapo_penalty(length: int, max_resp_len: int, buffer: int, factor: float) -> float:
    """veRL's DAPO manager, written out: min(-(L - (max - buffer)) / buffer * factor, 0)."""
    return min(-(length - (max_resp_len - buffer)) / buffer * factor, 0)


def test_dapo_manager_overlong_penalty_and_acc(tokenizer):
    # Responses of 2..12 tokens (text + eos); max_resp_len 10 with a 4-token buffer: penalties from 7 tokens on.
    texts = ["7" * k for k in range(1, 12)]
    batch = make_batch(tokenizer, texts, ["7"] * len(texts), "hybridflow/arithmetic")
    lengths = batch.batch["response_mask"].sum(-1).tolist()
    kwargs = {"overlong_buffer_cfg": {"enable": True, "len": 4, "penalty_factor": 0.5, "log": True},
              "max_resp_len": 10}
    with build_reward_manager("dapo", tokenizer, spec(reward_kwargs=kwargs)) as rm:
        result = rm(batch)
    expected = [verl_dapo_penalty(n, 10, 4, 0.5) for n in lengths]
    assert result.overlong_penalty.tolist() == pytest.approx(expected)
    assert min(expected) < -0.5  # lengths past max_resp_len keep falling, as veRL's formula does
    assert result.token_level_scores.sum(-1).tolist() == pytest.approx((result.scores + result.overlong_penalty).tolist())
    assert result.extra["acc"] == result.rule_scores.tolist()  # acc: the unshaped score
    assert result.extra["overlong"] == [p < 0 for p in expected]
    assert result.metrics["reward/overlong_fraction"] == pytest.approx(sum(p < 0 for p in expected) / len(expected))


def test_dapo_manager_takes_the_scorers_own_acc_and_defaults(tokenizer):
    batch = make_batch(tokenizer, ["abcdef", "zz"], ["dict", "ok"], "custom")
    with build_reward_manager("dapo", tokenizer, spec(custom_path=FNS, custom_name="misbehaving")) as rm:
        result = rm(batch)
    assert result.extra["acc"] == [1.0, 1.0]  # {"score": 0.5, "acc": 1.0} keeps its acc; a plain 1.0 is its own acc
    assert result.overlong_penalty is None  # no overlong_buffer_cfg: no shaping
    # max_resp_len defaults to data.max_response_length
    rm = build_reward_manager("dapo", tokenizer, spec(reward_kwargs={"overlong_buffer_cfg": {"enable": True, "len": 2}},
                                                      max_response_length=6))
    assert rm.overlong.max_resp_len == 6 and rm.overlong.penalty_factor == 1.0
    with pytest.raises(RewardConfigError, match="must be > 0"):
        build_reward_manager("dapo", tokenizer, spec(reward_kwargs={"overlong_buffer_cfg": {"enable": True}}))
    with pytest.raises(RewardConfigError, match="the overlong penalty is set twice"):  # old key and veRL's together
        build_reward_manager("dapo", tokenizer, spec(legacy_overlong=OverlongShaping(len=2, max_resp_len=8),
                                                     reward_kwargs={"overlong_buffer_cfg": {"enable": True, "len": 2}}))
    legacy = build_reward_manager("naive", tokenizer, spec(legacy_overlong=OverlongShaping(len=2, max_resp_len=8)))
    assert legacy.overlong.len == 2 and not legacy.record_acc  # the old key shapes under any manager


def test_prime_manager_reads_the_first_element_of_a_tuple(tokenizer):
    batch = make_batch(tokenizer, ["7", "8"], ["7", "9"])
    rm = build_reward_manager("prime", tokenizer, spec(custom_path=FNS, custom_name="with_tuple",
                                                       options={"num_workers": 1}))
    assert isinstance(rm, PrimeRewardManager)
    with rm:
        result = rm(batch)
    assert result.scores.tolist() == [1.0, 0.0] and result.extra["acc"] == [1.0, 0.0]
    with RewardManager(tokenizer, rm.compute_score, num_workers=0, max_failure_fraction=1.0) as naive:  # refused
        assert naive(batch).metrics["reward/invalid"] == 2


def test_verl_reward_keys_in_the_config():
    cfg = load_config([
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
        "+reward_model.reward_kwargs.max_resp_len=64",
    ])
    assert cfg.reward_model.reward_kwargs == {
        "overlong_buffer_cfg": {"enable": True, "len": 4, "penalty_factor": 1.0, "log": False}, "max_resp_len": 64}
    # newer veRL's top-level reward section names the same keys
    new = load_config(["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
                       "+reward.reward_kwargs.overlong_buffer_cfg.len=4", "+reward.reward_kwargs.max_resp_len=64",
                       f"reward.custom_reward_function.path={FNS}", "reward.custom_reward_function.name=exact",
                       "+reward.custom_reward_function.reward_kwargs.x=1"])
    assert new.reward_model.reward_manager == "dapo" and new.reward_model.reward_kwargs["max_resp_len"] == 64
    assert new.custom_reward_function.path == FNS and new.custom_reward_function.reward_kwargs == {"x": 1}
    with pytest.raises(ConfigError, match="'naive' reward manager takes none"):
        load_config(["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True"])
    with pytest.raises(ConfigError, match=r"reward_manager='nope': unknown reward manager 'nope'; known: .*batch, dapo, naive, prime"):
        load_config(["reward_model.reward_manager=nope"])
    with torch.no_grad():  # the manager a config builds
        from hybridflow.trainer.main import build_reward_fn

        cfg.reward_model.num_workers = 0
        rm = build_reward_fn(cfg, build_char_tokenizer())
        assert rm.overlong.max_resp_len == 64 and rm.overlong.len == 4 and rm.record_acc
