"""veRL's algorithm.rollout_correction.rollout_token_veto_threshold / rollout_is_batch_normalize reach the actor's
objective, and their start-up checks name the key."""

from __future__ import annotations

import pytest

from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.rl_trainer import is_on_policy
from hybridflow.workers.actor_rollout_ref import actor_loss_config

RC = "algorithm.rollout_correction"


def test_keys_reach_the_correction_settings_and_batch_normalize_needs_old_log_probs():
    cfg = load_config([f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_batch_normalize=true",
                       f"{RC}.rollout_token_veto_threshold=1e-4"])
    settings = actor_loss_config(cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction).correction
    assert settings.batch_normalize and settings.veto_threshold == 1e-4 and settings.enabled
    # one mini-batch, one epoch: on-policy, unless the batch mean of the weights is wanted before the update
    plain = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    assert is_on_policy(load_config([*plain, f"{RC}.rollout_is=token"]))
    assert not is_on_policy(load_config([*plain, f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true"]))
    veto_only = load_config([f"{RC}.rollout_token_veto_threshold=0.001"])
    assert actor_loss_config(veto_only.actor_rollout_ref.actor, veto_only.algorithm.rollout_correction
                             ).correction.enabled


@pytest.mark.parametrize("overrides, match", [
    ([f"{RC}.rollout_token_veto_threshold=2"], r"rollout_token_veto_threshold=2.* must be in \(0, 1\)"),
    ([f"{RC}.rollout_is_batch_normalize=true"], r"rollout_is_batch_normalize=true normalises .* rollout_is is off"),
    ([f"{RC}.bypass_mode=true", f"{RC}.rollout_token_veto_threshold=0.01"], r"the veto could never fire"),
    ([f"{RC}.use_policy_gradient=true"], r"not in hybridflow yet: this rollout-correction option"),
])
def test_bad_settings_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)
