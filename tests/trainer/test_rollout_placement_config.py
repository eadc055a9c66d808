"""Start-up errors for the rollout's placement and modes: each names the key and the fix, before any worker starts."""

from __future__ import annotations

import os

import pytest

from hybridflow.trainer.config import ConfigError, check_resources, load_config

SEPARATE = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.n_gpus_per_node=2"]
PLUGIN = os.path.join(os.path.dirname(__file__), "frozen_rollout_plugin.py")


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["trainer.rollout_mode=async", "trainer.max_staleness=-1", *SEPARATE], ["trainer.max_staleness=-1"]),
        (["trainer.rollout_mode=one_step_off"], ["trainer.rollout_mode=one_step_off", "hybrid_engine=false"]),
        (["trainer.rollout_mode=eventually"], ["trainer.rollout_mode='eventually'"]),
        (["trainer.rollout_mode=async", "algorithm.adv_estimator=gae", "critic.enable=false", *SEPARATE],
         ["algorithm.adv_estimator=gae needs a critic", "critic.enable=false"]),
        (["trainer.rollout_mode=one_step_off", "algorithm.adv_estimator=remax", *SEPARATE],
         ["adv_estimator=remax needs a greedy generation"]),
        (["trainer.rollout_mode=async", "algorithm.filter_groups.enable=true", *SEPARATE],
         ["algorithm.filter_groups.enable=true"]),
        (["trainer.max_staleness=3"], ["trainer.max_staleness applies to trainer.rollout_mode=async only"]),
        (["actor_rollout_ref.rollout.n_gpus_per_node=4"], ["actor_rollout_ref.rollout.n_gpus_per_node=4",
                                                          "hybrid_engine=false"]),
        ([*SEPARATE, "trainer.backend=local"], ["trainer.backend=local"]),
        ([*SEPARATE, "actor_rollout_ref.rollout.update_weights_bucket_megabytes=0"],
         ["update_weights_bucket_megabytes=0"]),
        ([f"actor_rollout_ref.rollout.name={PLUGIN}:FrozenRollout"], ["cannot load new weights"]),
        (["algorithm.rollout_correction.rollout_is=tokens"], ["rollout_correction.rollout_is='tokens'"]),
        (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0.9"],
         ["rollout_is_threshold=0.9"]),
        (["algorithm.rollout_correction.rollout_rs=token", "algorithm.rollout_correction.rollout_rs_threshold=0.5"],
         ["rejection band"]),
        (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token"],
         ["bypass_mode=true"]),
    ],
)
def test_bad_rollout_settings_are_refused_with_the_key(overrides, names):
    from hybridflow.engines.rollout.registry import ROLLOUT_ENGINES

    try:
        with pytest.raises(ConfigError) as err:
            load_config(overrides)
    finally:  # an import-path engine stays registered once looked up; other tests list the registry
        for name in ROLLOUT_ENGINES.names():
            if name.startswith(PLUGIN):
                ROLLOUT_ENGINES.remove(name)
    for name in names:
        assert name in str(err.value), str(err.value)


def test_good_settings_load():
    cfg = load_config(["trainer.rollout_mode=async", "trainer.max_staleness=0", "trainer.rollout_buffer_batches=3",
                       *SEPARATE, "algorithm.rollout_correction.rollout_is=sequence"])
    assert cfg.trainer.rollout_mode == "async" and cfg.actor_rollout_ref.rollout.n_gpus_per_node == 2


def test_a_placement_that_does_not_fit_the_cluster():
    cfg = load_config(["trainer.n_gpus_per_node=2", *SEPARATE, "trainer.device=cuda"])
    with pytest.raises(ConfigError, match=r"4 GPU ranks .*rollout\.nnodes"):
        check_resources(cfg, available_cpus=16, available_gpus=3)
    check_resources(cfg, available_cpus=16, available_gpus=4)


def test_verls_fully_async_recipe_keys_are_refused_naming_hybridflows_async_keys():
    with pytest.raises(ConfigError, match=r"async_training\.staleness_threshold: veRL's fully-async recipe .*"
                                          r"trainer\.rollout_mode=async.*trainer\.max_staleness"):
        load_config(["async_training.staleness_threshold=0.5"])
