#!/usr/bin/env bash
# RLOO (Ahmadian et al. 2024): leave-one-out baseline within each prompt's group.
# Runs on the built-in arithmetic task from the shipped base policy; add overrides after the script name,
# e.g. `bash examples/rloo.sh data.train_files=my.parquet actor_rollout_ref.model.path=MODEL`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/hybridflow train \
    algorithm.adv_estimator=rloo \
    actor_rollout_ref.rollout.n=8 \
    trainer.experiment_name=rloo \
    "$@"
