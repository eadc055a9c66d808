#!/usr/bin/env bash
# ReMax (Li et al. 2023): reward minus the greedy response's reward as the baseline.
# Runs on the built-in arithmetic task from the shipped base policy; add overrides after the script name,
# e.g. `bash examples/remax.sh data.train_files=my.parquet actor_rollout_ref.model.path=MODEL`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/hybridflow train \
    algorithm.adv_estimator=remax \
    actor_rollout_ref.rollout.n=4 \
    trainer.experiment_name=remax \
    "$@"
