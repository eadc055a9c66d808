"""A run honours actor.checkpoint.save_contents / load_contents (in-process backend): the step folder holds what was
asked, and resuming it asks only for what is there."""

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
