#!/usr/bin/env bash
# Built-in agent task (calculator): generated demonstrations -> `hybridflow sft` base policy (once, cached under $OUT/base)
# -> multi-turn GRPO with the preset hybridflow/config/agent_calculator_grpo.yaml. The run measures the base first
# (trainer.val_before_train) and prints held-out accuracy before/after; add overrides after the script name.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/agent_calculator}
# Two SFT stages (as measured in docs/benchmarks.md): 300 steps from random init on the demonstrations, then 200
# steps at a lower learning rate on demonstrations that repeat the copy-the-tool-result example 3 times.
if [ ! -f "$OUT/base/model.safetensors" ]; then
    .venv/bin/python -m hybridflow.trainer.make_agent_base calculator --data-dir "$OUT/data1" --out "$OUT/base1" \
        --steps 300 --task-kwargs '{"answer_repeats": 1}'
    .venv/bin/python -m hybridflow.trainer.make_agent_base calculator --data-dir "$OUT/data" --out "$OUT/base" \
        --steps 200 --init "$OUT/base1" --lr 2e-3
fi
exec .venv/bin/hybridflow train --config hybridflow/config/agent_calculator_grpo.yaml \
    data.train_files="$OUT/data/train.parquet" \
    data.val_files="$OUT/data/val.parquet" \
    actor_rollout_ref.model.path="$OUT/base" \
    trainer.default_local_dir="$OUT/run" \
    trainer.experiment_name=agent_calculator \
    "$@"
