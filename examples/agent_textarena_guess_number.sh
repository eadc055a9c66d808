#!/usr/bin/env bash
# Built-in agent task on a real environment library, as-is: textarena's GuessTheNumber-v0-raw (pip install textarena;
# hybridflow's `textarena` environment, agents/adapters/textarena_env.py). Demonstrations played on the real game ->
# `hybridflow sft` base policy (once, cached under $OUT/base) -> multi-turn GRPO with the preset
# hybridflow/config/agent_textarena_guess_number_grpo.yaml. The run measures the base first (trainer.val_before_train)
# and prints the held-out numbers before/after; add overrides after the script name (one torch thread per process,
# as measured; override with trainer.num_threads_per_worker=N).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/agent_textarena_guess_number}
if [ ! -f "$OUT/base/model.safetensors" ]; then
    .venv/bin/python -m hybridflow.trainer.make_agent_base textarena_guess_number --data-dir "$OUT/data" \
        --out "$OUT/base" --threads 1
fi
exec .venv/bin/hybridflow train --config hybridflow/config/agent_textarena_guess_number_grpo.yaml \
    data.train_files="$OUT/data/train.parquet" \
    data.val_files="$OUT/data/val.parquet" \
    actor_rollout_ref.model.path="$OUT/base" \
    trainer.default_local_dir="$OUT/run" \
    trainer.num_threads_per_worker=1 \
    "$@"
