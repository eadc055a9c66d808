"""The same PPO step under every placement: all roles colocated in shared processes, the critic on its own pool,
and the single-process local backend — on real Ray with 2 ranks where it matters."""

from __future__ import annotations

import json
import math

import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training

PPO = ("algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "algorithm.use_kl_in_reward=true")


@pytest.mark.parametrize(
    "placement",
    [
        ("trainer.backend=ray", "trainer.n_gpus_per_node=2", "trainer.placement=colocate"),
        ("trainer.backend=ray", "trainer.n_gpus_per_node=2", "trainer.placement=split"),
    ],
    ids=["ray-colocate", "ray-split"],
)
def test_ppo_runs_under_placement(placement, ray_session, arithmetic_files, tiny_model_path, tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, *PPO, *placement))
    result = run_training(cfg, progress=False)
    assert result.global_step == 2
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    for row in rows:
        for key in ("actor/pg_loss", "critic/vf_loss", "actor/reward_kl_penalty", "timing/values", "timing/ref"):
            assert math.isfinite(row[key]), key
        assert row["rollout/mismatch_mean_abs"] <= 1e-5


def test_colocated_roles_share_processes(ray_session, arithmetic_files, tiny_model_path, tmp_path):
    from hybridflow.trainer.placement import build_worker_groups

    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, str(tmp_path), *PPO,
                                         "trainer.backend=ray", "trainer.n_gpus_per_node=2"))
    groups = build_worker_groups(cfg, need_ref=True, need_critic=True, need_rm=False)
    try:
        actor_pids = [i["pid"] for i in groups.actor_rollout.worker_info]
        critic_pids = [i["pid"] for i in groups.critic.worker_info]
        assert actor_pids == critic_pids and len(set(actor_pids)) == 2
    finally:
        groups.shutdown()
