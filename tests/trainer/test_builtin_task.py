"""The built-in task and its base policy: regeneration works (a short run of the documented command), and GRPO from
the shipped base raises held-out accuracy on a short seeded schedule."""

from __future__ import annotations

import json
import os

from hybridflow.data.builtin import builtin_base_model_path, ensure_builtin_task_files
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import BUILTIN_PRESET, run_training
from hybridflow.trainer.make_base_model import greedy_accuracy, heldout_accuracy, main


def test_regenerating_the_base_model_writes_a_loadable_model(tmp_path):
    out = str(tmp_path / "base")
    assert main(["--out", out, "--sft-steps", "6", "--batch-size", "16", "--eval-every", "3", "--target-accuracy", "1.0"]) == 0
    info = json.load(open(os.path.join(out, "hybridflow_base.json")))
    assert info["sft_steps"] == 6 and len(info["probes"]) == 1 and 0.0 <= info["val_greedy_accuracy"] <= 1.0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template


def test_shipped_base_is_competent_but_far_from_perfect():
    _, val = ensure_builtin_task_files()
    path = builtin_base_model_path()
    # Greedy decoding shows what the base knows; sampling (the main job's held-out metric) shows how often it states
    # a verifiable answer, which is what RL improves.
    assert greedy_accuracy(path, val) >= 0.3
    sampled = heldout_accuracy(path, val, greedy=False, n=4)
    assert 0.15 <= sampled <= 0.45, sampled


def test_grpo_raises_held_out_accuracy(ray_session, tmp_path):
    cfg = load_config([
        "trainer.total_training_steps=30", f"trainer.default_local_dir={tmp_path}", "trainer.resume_mode=disable",
        "trainer.test_freq=30", "trainer.save_freq=0", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        "data.val_max_samples=128",
    ], preset=BUILTIN_PRESET)
    result = run_training(cfg, progress=False)
    key = "val/hybridflow/arithmetic/mean@4"
    before, after = result.initial_val[key], result.last_metrics[key]
    assert after >= before + 0.10, (before, after)
