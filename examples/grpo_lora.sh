#!/usr/bin/env bash
# GRPO with LoRA (PEFT adapters on every linear layer of the actor, rank 8, alpha 16): only the adapters train and
# hold optimizer state; the KL reference is the same base weights with the adapter disabled, so no second copy of the
# model is held; the rollout gets the merged weights W + (alpha/r) B A. LoRA needs a higher lr than full fine-tuning
# (2e-3 here vs the main job's 2e-4). Export the merged model with `hybridflow export RUN OUT`, the adapter alone
# with `hybridflow export RUN OUT --adapter`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/hybridflow train \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.model.lora_rank=8 \
    actor_rollout_ref.model.lora_alpha=16 \
    actor_rollout_ref.model.target_modules=all-linear \
    actor_rollout_ref.actor.optim.lr=2e-3 \
    actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    trainer.experiment_name=grpo_lora \
    "$@"
