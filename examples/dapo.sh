#!/usr/bin/env bash
# DAPO (Yu et al. 2025) with veRL's DAPO recipe keys: clip-higher, dynamic sampling (generation batches of
# data.gen_batch_size prompts, groups whose acc is the same for all n samples dropped, generation repeated until
# data.train_batch_size groups are kept, at most max_num_gen_batches times), the dapo reward manager's soft overlong
# penalty, token-mean loss. Runs on the built-in arithmetic task from the shipped base policy (train_batch_size 64 of
# its preset); add overrides after the script name,
# e.g. `bash examples/dapo.sh data.train_files=my.parquet actor_rollout_ref.model.path=MODEL`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/hybridflow train \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    data.gen_batch_size=96 \
    algorithm.filter_groups.enable=true \
    algorithm.filter_groups.metric=acc \
    algorithm.filter_groups.max_num_gen_batches=4 \
    reward_model.reward_manager=dapo \
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True \
    +reward_model.reward_kwargs.overlong_buffer_cfg.len=4 \
    +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
    +reward_model.reward_kwargs.overlong_buffer_cfg.log=False \
    trainer.experiment_name=dapo \
    "$@"
