#!/usr/bin/env bash
# A reasoning-gym task end to end: SFT a random-init tiny model on the task's gold answers (format warm start), then
# GRPO on the same task from that base, scored by the task's own score_answer; the RL run prints held-out
# accuracy before and after. TASK/OPTS pick any reasoning-gym task and its options; OUT is the work folder.
#   bash examples/reasoning_gym.sh                      # basic_arithmetic: two terms of one or two digits
#   TASK=chain_sum OPTS='min_terms=2&max_terms=2' bash examples/reasoning_gym.sh trainer.total_training_steps=40
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${TASK:-basic_arithmetic}
OPTS=${OPTS:-min_terms=2&max_terms=2&min_digits=1&max_digits=2&allow_parentheses=false&allow_negation=false}
OUT=${OUT:-outputs/reasoning_gym_$TASK}
SFT_STEPS=${SFT_STEPS:-200}
SRC="reasoning_gym:$TASK?system_prompt=none&$OPTS"

.venv/bin/hybridflow make-tiny-model "$OUT/init" --size tiny
.venv/bin/hybridflow sft "data.train_files=$SRC&size=8192&seed=100" data.response_key=extra_info.response data.max_length=64 \
    data.train_batch_size=64 data.micro_batch_size_per_gpu=64 "model.path=$OUT/init" optim.lr=3e-3 \
    optim.lr_scheduler_type=constant "trainer.total_training_steps=$SFT_STEPS" "trainer.default_local_dir=$OUT/sft" \
    trainer.logger=[jsonl]
exec .venv/bin/hybridflow train \
    algorithm.adv_estimator=grpo \
    "data.train_files=$SRC&size=4096&seed=1" "data.val_files=$SRC&size=256&seed=2" \
    "actor_rollout_ref.model.path=$OUT/sft/huggingface" \
    data.max_prompt_length=48 data.max_response_length=24 data.train_batch_size=64 \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192 \
    actor_rollout_ref.actor.optim.lr=2e-4 actor_rollout_ref.actor.optim.weight_decay=0.0 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=true actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
    actor_rollout_ref.rollout.val_kwargs.n=4 \
    trainer.total_training_steps=40 trainer.test_freq=20 "trainer.default_local_dir=$OUT/grpo" \
    trainer.experiment_name=reasoning_gym \
    "$@"
