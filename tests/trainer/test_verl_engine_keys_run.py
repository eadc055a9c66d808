"""Runs (in-process backend) honour veRL's engine keys: actor.checkpoint.save_contents / load_contents (the step
folder holds what was asked, resuming asks only for what is there) and a bf16 actor (fsdp_config.model_dtype)."""

from __future__ import annotations

import json
import os

import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training


def test_model_and_hf_copy_only_then_resume_without_optimizer(arithmetic_files, tiny_model_path, tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    base = tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local", "trainer.save_freq=1",
                              "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]")
    run_training(load_config([*base, "trainer.total_training_steps=1"]), progress=False)
    actor = os.path.join(run_dir, "global_step_1", "actor")
    assert json.load(open(os.path.join(actor, "meta.json")))["contents"] == ["model"]
    assert os.path.exists(os.path.join(actor, "huggingface", "model.safetensors"))

    # the default load_contents is save_contents (veRL's ${.save_contents}): the resume takes the model only
    resumed = load_config([*base, "trainer.total_training_steps=2", "trainer.resume_mode=auto"])
    with caplog.at_level("WARNING"):
        assert run_training(resumed, progress=False).global_step == 2
    assert any("without its optimizer and extra" in r.message for r in caplog.records)

    # asking a resume for the optimizer state this checkpoint does not hold is refused, naming what it holds
    strict = load_config([*base, "trainer.total_training_steps=3", "trainer.resume_mode=auto",
                          "actor_rollout_ref.actor.checkpoint.load_contents=[model,optimizer,extra]"])
    with pytest.raises(Exception, match=r"holds \['model'\] but resuming asks for \['optimizer', 'extra'\]"):
        run_training(strict, progress=False)


def test_a_bf16_actor_trains_and_syncs_its_weights_to_the_rollout(arithmetic_files, tiny_model_path, tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local",
                                         "trainer.total_training_steps=2", "actor_rollout_ref.model.torch_dtype=bf16",
                                         "actor_rollout_ref.actor.use_kl_loss=true"))
    run_training(cfg, progress=False)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2 and all(abs(r["actor/grad_norm"]) < float("inf") for r in steps)
