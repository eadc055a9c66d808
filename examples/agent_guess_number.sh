#!/usr/bin/env bash
# Built-in agent task (guess_number): generated demonstrations -> `hybridflow sft` base policy (once, cached under $OUT/base)
# -> multi-turn GRPO with the preset hybridflow/config/agent_guess_number_grpo.yaml. The run measures the base first
# (trainer.val_before_train) and prints held-out accuracy before/after; add overrides after the script name.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/agent_guess_number}
if [ ! -f "$OUT/base/model.safetensors" ]; then
    .venv/bin/python -m hybridflow.trainer.make_agent_base guess_number --data-dir "$OUT/data" --out "$OUT/base"
fi
exec .venv/bin/hybridflow train --config hybridflow/config/agent_guess_number_grpo.yaml \
    data.train_files="$OUT/data/train.parquet" \
    data.val_files="$OUT/data/val.parquet" \
    actor_rollout_ref.model.path="$OUT/base" \
    trainer.default_local_dir="$OUT/run" \
    trainer.experiment_name=agent_guess_number \
    "$@"
