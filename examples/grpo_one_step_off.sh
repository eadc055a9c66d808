#!/usr/bin/env bash
# GRPO with the rollout in a process of its own, generating step k+1 while the actor trains on step k
# (trainer.rollout_mode=one_step_off); the samples are one policy version old, so the actor re-scores them and a
# truncated importance weight pi_old / pi_rollout per token corrects the loss (decoupled PPO).
# `trainer.rollout_mode=async trainer.max_staleness=2` instead keeps the rollout generating into a buffer.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/hybridflow train \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.hybrid_engine=false \
    actor_rollout_ref.rollout.n_gpus_per_node=1 \
    trainer.rollout_mode=one_step_off \
    algorithm.rollout_correction.rollout_is=token \
    algorithm.rollout_correction.rollout_is_threshold=2.0 \
    trainer.experiment_name=grpo_one_step_off \
    "$@"
