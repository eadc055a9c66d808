#!/usr/bin/env bash
# DAPO (Yu et al. 2025): clip-higher, dynamic sampling that refills filtered groups, overlong shaping, token-mean loss.
# Runs on the built-in arithmetic task from the shipped base policy; add overrides after the script name,
# e.g. `bash examples/dapo.sh data.train_files=my.parquet actor_rollout_ref.model.path=MODEL`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/hybridflow train \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    algorithm.filter_groups.enable=true \
    algorithm.filter_groups.max_num_gen_batches=4 \
    reward_model.overlong_buffer.enable=true \
    reward_model.overlong_buffer.len=4 \
    reward_model.overlong_buffer.penalty_factor=1.0 \
    trainer.experiment_name=dapo \
    "$@"
