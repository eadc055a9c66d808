#!/usr/bin/env bash
# GRPO (Shao et al. 2024): group-normalised advantages, no critic; KL as a loss term.
# Runs on the built-in arithmetic task from the shipped base policy; add overrides after the script name,
# e.g. `bash examples/grpo.sh data.train_files=my.parquet actor_rollout_ref.model.path=MODEL`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/hybridflow train \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    trainer.experiment_name=grpo \
    "$@"
