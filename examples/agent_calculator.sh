#!/usr/bin/env bash
# Built-in agent task (calculator): generated demonstrations -> `hybridflow sft` base policy (once, cached under $OUT/base)
# -> multi-turn GRPO with the preset hybridflow/config/agent_calculator_grpo.yaml. The run measures the base first
# (trainer.val_before_train) and prints held-out accuracy before/after; add overrides after the script name.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/agent_calculator}
# Two SFT stages from random init on the same demonstration conversations (make_agent_base.RECIPES): 480 steps at
# lr 3e-3, then 360 more at 2e-3 (copying the operands into the call and the tool's result into the answer is what
# the 2-layer model learns last: held-out accuracy is still 0 after the first stage). The base's held-out numbers
# land in $OUT/base/hybridflow_base.json. One torch thread, as measured in docs/benchmarks.md.
if [ ! -f "$OUT/base/model.safetensors" ]; then
    .venv/bin/python -m hybridflow.trainer.make_agent_base calculator --data-dir "$OUT/data" --out "$OUT/base1" \
        --threads 1 --steps 480
    .venv/bin/python -m hybridflow.trainer.make_agent_base calculator --data-dir "$OUT/data" --out "$OUT/base" \
        --threads 1 --steps 360 --init "$OUT/base1" --lr 2e-3 --evaluate
fi
exec .venv/bin/hybridflow train --config hybridflow/config/agent_calculator_grpo.yaml \
    data.train_files="$OUT/data/train.parquet" \
    data.val_files="$OUT/data/val.parquet" \
    actor_rollout_ref.model.path="$OUT/base" \
    trainer.default_local_dir="$OUT/run" \
    trainer.experiment_name=agent_calculator \
    trainer.num_threads_per_worker=1 \
    "$@"
