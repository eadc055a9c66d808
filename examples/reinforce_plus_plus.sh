#!/usr/bin/env bash
# REINFORCE++ (Hu 2025): discounted returns whitened over the batch, KL penalty in the reward.
# Runs on the built-in arithmetic task from the shipped base policy; add overrides after the script name,
# e.g. `bash examples/reinforce_plus_plus.sh data.train_files=my.parquet actor_rollout_ref.model.path=MODEL`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/hybridflow train \
    algorithm.adv_estimator=reinforce_plus_plus \
    algorithm.use_kl_in_reward=true \
    algorithm.kl_ctrl.kl_coef=0.001 \
    actor_rollout_ref.rollout.n=8 \
    trainer.experiment_name=reinforce_plus_plus \
    "$@"
