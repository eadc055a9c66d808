"""veRL's global micro-batch keys become the per-rank keys (divided by the role's data-parallel ranks, as veRL's
workers divide them), and trainer.use_legacy_worker_impl selects hybridflow's one worker implementation."""

from __future__ import annotations

import pytest

from hybridflow.trainer.config import ConfigError, classify_overrides, load_config, merge_overrides
from hybridflow.trainer.sft_trainer import SFTConfig


def test_global_actor_micro_batch_is_divided_by_the_data_parallel_ranks_whatever_the_key_order():
    # the global key comes before the rank count on the command line: the division waits for every key
    cfg = load_config(["actor_rollout_ref.actor.ppo_micro_batch_size=16", "trainer.n_gpus_per_node=4",
                       "trainer.nnodes=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size=32",
                       "actor_rollout_ref.ref.log_prob_micro_batch_size=64", "critic.ppo_micro_batch_size=8",
                       "critic.forward_micro_batch_size=32"], validate=False)
    arr = cfg.actor_rollout_ref
    assert arr.actor.ppo_micro_batch_size_per_gpu == 2  # 16 rows over 8 ranks
    assert arr.rollout.log_prob_micro_batch_size_per_gpu == 4
    assert arr.ref.log_prob_micro_batch_size_per_gpu == 8
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 1
    assert cfg.critic.forward_micro_batch_size_per_gpu == 4  # the value pass's own size (None: the update's)


def test_the_critics_value_pass_sizes_are_taken_and_bad_ones_are_named():
    # the critic worker gives them to its engine as the forward-only sizes (test_every_key_has_an_effect sees it read)
    critic = load_config(["critic.forward_micro_batch_size_per_gpu=3", "critic.forward_max_token_len_per_gpu=512",
                          "algorithm.adv_estimator=gae"]).critic
    assert (critic.forward_micro_batch_size_per_gpu, critic.forward_max_token_len_per_gpu) == (3, 512)
    with pytest.raises(ConfigError, match=r"critic\.forward_max_token_len_per_gpu=0 must be >= 1"):
        load_config(["critic.forward_max_token_len_per_gpu=0"])


def test_sequence_parallel_ranks_share_rows_so_they_count_once():
    cfg = load_config(["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                       "actor_rollout_ref.actor.ppo_micro_batch_size=8",
                       "actor_rollout_ref.ref.log_prob_micro_batch_size=8"], validate=False)
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4  # 2 data-parallel groups of 2 ranks
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 2  # the ref has no SP here: 4 groups


def test_null_leaves_the_per_rank_key_and_equal_settings_agree():
    default = load_config([], validate=False).actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    assert load_config(["actor_rollout_ref.actor.ppo_micro_batch_size=null"], validate=False
                       ).actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == default
    cfg = load_config(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=8",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"], validate=False)
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4


@pytest.mark.parametrize("overrides, match", [
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_micro_batch_size=6"],
     r"ppo_micro_batch_size=6 .* does not split over the 4 data-parallel ranks"),
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=8",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
     r"means actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu=4 on 2 .*_per_gpu=2 is set too; keep one"),
    (["actor_rollout_ref.ref.log_prob_micro_batch_size=0"], r"log_prob_micro_batch_size=0 must be a positive"),
])
def test_bad_global_micro_batches_are_errors_naming_the_keys(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides, validate=False)


def test_a_converted_size_is_validated_like_a_per_rank_one():
    # 16 responses per mini-batch on 2 ranks = 8 each, which micro-batches of 16 // 2 = 8 split; 12 // 2 = 6 do not
    ok = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.n_gpus_per_node=2"]
    load_config([*ok, "actor_rollout_ref.actor.ppo_micro_batch_size=16"])
    with pytest.raises(ConfigError, match=r"ppo_micro_batch_size_per_gpu=6"):
        load_config([*ok, "actor_rollout_ref.actor.ppo_micro_batch_size=12"])


def test_sft_micro_batch_size_is_divided_by_the_sft_ranks():
    cfg = merge_overrides(SFTConfig, ["data.micro_batch_size=8", "trainer.n_gpus_per_node=4"])
    assert cfg.data.micro_batch_size_per_gpu == 2
    kinds = classify_overrides(["data.micro_batch_size=4"], SFTConfig)
    assert kinds["renamed"] == ["data.micro_batch_size -> data.micro_batch_size_per_gpu (divided by the "
                                "data-parallel ranks)"]
    # an RL run has no such key: refused with the reason
    assert classify_overrides(["data.micro_batch_size=4"])["refused"]


def test_use_legacy_worker_impl_auto_and_disable_are_taken_enable_is_refused():
    for value in ("auto", "disable"):
        assert load_config([f"trainer.use_legacy_worker_impl={value}"]).trainer.use_legacy_worker_impl == value
    with pytest.raises(ConfigError, match=r"use_legacy_worker_impl=enable: veRL's legacy workers are not in"):
        load_config(["trainer.use_legacy_worker_impl=enable"])
    with pytest.raises(ConfigError, match=r"use_legacy_worker_impl='sometimes': choose auto or disable"):
        load_config(["trainer.use_legacy_worker_impl=sometimes"])
