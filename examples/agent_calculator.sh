#!/usr/bin/env bash
# Built-in agent task (calculator): generated demonstrations -> `hybridflow sft` base policy (once, cached under $OUT/base)
# -> multi-turn GRPO with the preset hybridflow/config/agent_calculator_grpo.yaml. The run measures the base first
# (trainer.val_before_train) and prints held-out accuracy before/after; add overrides after the script name.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/agent_calculator}
# One SFT stage from random init on whole demonstration conversations (the recipe in make_agent_base.RECIPES; the
# base's held-out numbers land in $OUT/base/hybridflow_base.json). One torch thread: the numbers in
# docs/benchmarks.md were measured that way on a shared 2-core machine.
if [ ! -f "$OUT/base/model.safetensors" ]; then
    .venv/bin/python -m hybridflow.trainer.make_agent_base calculator --data-dir "$OUT/data" --out "$OUT/base" \
        --threads 1 --evaluate
fi
exec .venv/bin/hybridflow train --config hybridflow/config/agent_calculator_grpo.yaml \
    data.train_files="$OUT/data/train.parquet" \
    data.val_files="$OUT/data/val.parquet" \
    actor_rollout_ref.model.path="$OUT/base" \
    trainer.default_local_dir="$OUT/run" \
    trainer.experiment_name=agent_calculator \
    "$@"
