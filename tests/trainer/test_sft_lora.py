"""LoRA SFT (`hybridflow sft model.lora_rank=...`, veRL's SFT keys): only the adapter trains, the NLL falls, and the
saved model is the base with the adapter merged in -- a plain transformers folder the RL job loads by path."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.data.builtin import ensure_builtin_task_files
from hybridflow.trainer.config import ConfigError
from hybridflow.trainer.sft_trainer import load_sft_config, run_sft


def _overrides(model: str, out: str, *extra: str) -> list[str]:
    train, _ = ensure_builtin_task_files()
    return [f"data.train_files={train}", "data.response_key=extra_info.response", "data.max_length=96",
            "data.train_batch_size=16", "data.micro_batch_size_per_gpu=16", f"model.path={model}", "optim.lr=5e-3",
            "trainer.total_training_steps=6", "trainer.log_freq=1", f"trainer.default_local_dir={out}", "trainer.backend=local",
            "trainer.logger=[jsonl]", "optim.lr_scheduler_type=constant", "optim.warmup_ratio=0.0", *extra]


def test_lora_sft_learns_and_saves_a_merged_model(tiny_model_path, tmp_path):
    out = str(tmp_path / "sft")
    summary = run_sft(load_sft_config(_overrides(tiny_model_path, out, "model.lora_rank=8", "model.lora_alpha=16",
                                                 "model.target_modules=[q_proj,v_proj,up_proj]")))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        nll = [json.loads(line)["train/nll"] for line in f]
    assert nll[-1] < nll[0] - 0.1, nll
    merged = AutoModelForCausalLM.from_pretrained(summary["model_dir"])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert not any("lora" in name for name in merged.state_dict())
    changed = {n for (n, a), b in zip(merged.named_parameters(), base.parameters()) if not torch.equal(a, b)}
    # only the adapted projections moved (embeddings, norms and the other linears are the base's)
    assert changed and all(any(t in n for t in ("q_proj", "v_proj", "up_proj")) for n in changed), changed


def test_bad_lora_rank_and_batch_split_are_config_errors_before_the_data_is_read(tiny_model_path, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.lora_rank=-1"):
        load_sft_config(_overrides(tiny_model_path, str(tmp_path / "x"), "model.lora_rank=-1"))
    with pytest.raises(ConfigError, match=r"data\.train_batch_size=16 must split into 2 ranks x whole micro-batches"):
        load_sft_config(_overrides(tiny_model_path, str(tmp_path / "x"), "trainer.n_gpus_per_node=2",
                                   "data.micro_batch_size_per_gpu=3"))
    with pytest.raises(ConfigError, match=r"unknown logger\(s\) \['wand'\]"):
        load_sft_config(_overrides(tiny_model_path, str(tmp_path / "x"), "trainer.logger=[console,wand]"))
    built_in_code = load_sft_config(_overrides(tiny_model_path, str(tmp_path / "x")))
    built_in_code.model.lora_rank = -2  # run_sft checks a config it did not load
    with pytest.raises(ConfigError, match=r"model\.lora_rank=-2"):
        run_sft(built_in_code)
