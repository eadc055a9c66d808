#!/usr/bin/env bash
# PPO with a critic (GAE advantages, clipped value loss, KL penalty in the reward).
# Runs on the built-in arithmetic task from the shipped base policy; add overrides after the script name,
# e.g. `bash examples/ppo.sh data.train_files=my.parquet actor_rollout_ref.model.path=MODEL`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/hybridflow train \
    algorithm.adv_estimator=gae \
    algorithm.gamma=1.0 \
    algorithm.lam=0.95 \
    algorithm.use_kl_in_reward=true \
    actor_rollout_ref.rollout.n=4 \
    data.train_batch_size=64 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    critic.optim.lr=1e-3 \
    trainer.experiment_name=ppo \
    "$@"
