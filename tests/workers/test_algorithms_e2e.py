"""Every algorithm the driver offers runs end to end on a tiny model: finite losses, its metrics present, the actor's
weights change, and the rollout engine follows the actor (its log-probs equal the actor's after every sync)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from e2e_helpers import tiny_run_overrides

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training

ALGORITHMS = {
    "grpo": [],
    "dr_grpo": ["algorithm.adv_estimator=dr_grpo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.use_kl_in_reward=true"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "remax": ["algorithm.adv_estimator=remax"],
    "ppo_gae_critic": ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.optim.lr=1e-3"],
    "dapo": [
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    ],
    "dapo_verl_reward_keys": [  # veRL's DAPO recipe keys: the dapo reward manager's overlong buffer, groups by acc
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=2", "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=True", "+reward_model.reward_kwargs.max_resp_len=8",
    ],
    "gspo": [
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_low=0.0003",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    ],
    "grpo_kl_loss_entropy": [
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
    ],
    "cispo_two_epochs": [
        "actor_rollout_ref.actor.policy_loss.loss_mode=cispo", "actor_rollout_ref.actor.ppo_epochs=2",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    ],
}


def _rows(run_dir: str) -> list[dict]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_algorithm_runs_and_learns_something(name, arithmetic_files, tiny_model_path, tmp_path):
    run_dir = str(tmp_path / name)
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local",
                                         "trainer.save_freq=2", *ALGORITHMS[name]))
    result = run_training(cfg, progress=False)
    assert result.global_step == 2
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean",
                    "timing/generate", "timing/update_actor", "timing/sync_weights"):
            assert key in row and row[key] is not None and math.isfinite(row[key]), (name, key, row.get(key))
        assert row["actor/skipped_nonfinite"] == 0
    if name == "ppo_gae_critic":
        assert all(math.isfinite(r["critic/vf_loss"]) for r in rows) and "timing/values" in rows[0]
        # the critic's checkpoint merges (veRL's model-merger command) into a value model with the trained weights
        from transformers import AutoModelForTokenClassification

        from hybridflow.trainer.export import load_full_actor_state
        from hybridflow.trainer.merge import merge_checkpoint

        critic_dir = os.path.join(run_dir, "global_step_2", "critic")
        merged = merge_checkpoint(critic_dir, str(tmp_path / "critic_hf"))
        value_model = AutoModelForTokenClassification.from_pretrained(merged)
        assert type(value_model).__name__.endswith("ForTokenClassification") and value_model.config.num_labels == 1
        trained = load_full_actor_state(critic_dir)
        assert all(torch.equal(p, trained[n]) for n, p in value_model.named_parameters())
    if name.startswith("dapo"):  # the reward manager applied the overlong penalty (old key and veRL's alike)
        assert all(r["reward/overlong_penalty_mean"] <= 0 for r in rows) and rows[0]["reward/overlong_penalty_mean"] < 0
        assert ("reward/overlong_fraction" in rows[0]) == (name == "dapo_verl_reward_keys")  # overlong_buffer_cfg.log
    if "kl" in name or name == "reinforce_plus_plus":
        assert "timing/ref" in rows[0]
    # After step 1's sync the rollout engine must hold exactly the actor's weights: the log-probs it reports for
    # its own samples at step 2 equal the actor's (fp32 on CPU).
    assert rows[1]["rollout/mismatch_mean_abs"] <= 1e-5, (name, rows[1]["rollout/mismatch_mean_abs"])
    # The actor's weights changed.
    from hybridflow.trainer.export import export_checkpoint

    exported = export_checkpoint(run_dir, str(tmp_path / "export"))
    before, after = _weights(tiny_model_path), _weights(exported)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, f"{name}: no parameter changed after two updates"
