"""A LoRA run (actor_rollout_ref.model.lora_rank > 0) resumes bitwise: metrics and the exported merged weights of a
run resumed from its step-2 checkpoint equal an uninterrupted run's; the checkpoint holds only the adapter."""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch
from e2e_helpers import tiny_run_overrides
from test_resume_and_restart import STEPS, _assert_same_run, _overrides

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training

SEPARATE = ("trainer.backend=ray", "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.update_weights_bucket_megabytes=1")
# The random model scores 0 on every prompt (no advantage) and starts equal to its reference (no KL gradient): the
# entropy bonus is what moves the adapter, so that the resumed run has real updates to reproduce.
LORA = ("trainer.backend=local", "trainer.resume_mode=auto", "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.actor.optim.lr=2e-3",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01")


def test_lora_run_resumes_bitwise_from_an_adapter_checkpoint(arithmetic_files, tiny_model_path, tmp_path, caplog):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    for run_dir in (straight, resumed):
        run_training(load_config(_overrides(arithmetic_files, tiny_model_path, run_dir, *LORA)), progress=False)
    from safetensors.torch import load_file

    with open(os.path.join(straight, "metrics.jsonl")) as f:  # hybrid engine: merged weights synced in process
        assert all(json.loads(line)["rollout/mismatch_max_abs"] <= 1e-5 for line in f)
    adapter = load_file(os.path.join(straight, f"global_step_{STEPS}", "actor", "model_rank0.safetensors"))
    assert adapter and all(".lora_" in name for name in adapter)
    # Drop the last checkpoint of the second run and run the same command again: it resumes from step STEPS - 1.
    shutil.rmtree(os.path.join(resumed, f"global_step_{STEPS}"))
    with open(os.path.join(resumed, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(STEPS - 1))
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.main"):
        run_training(load_config(_overrides(arithmetic_files, tiny_model_path, resumed, *LORA)), progress=False)
    assert f"resuming from {os.path.join(resumed, f'global_step_{STEPS - 1}')}" in caplog.text
    assert os.path.isdir(os.path.join(resumed, f"global_step_{STEPS}"))
    _assert_same_run(straight, resumed, tmp_path)
    # the run really changed the model (the merged export differs from the base)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    merged = load_file(os.path.join(str(tmp_path), "export-straight", "model.safetensors"))
    assert any(not torch.equal(merged[k], base[k]) for k in merged)


def test_lora_weights_reach_a_rollout_group_of_its_own_merged(ray_session, arithmetic_files, tiny_model_path,
                                                              tmp_path):
    """hybrid_engine=false: the merged weights (base names) go over the transfer group; the rollout's log-probs
    equal the actor's after every transfer."""
    run_dir = str(tmp_path / "run")
    lora = [o for o in LORA if o.startswith("actor_rollout_ref.")]
    run_training(load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, *SEPARATE, *lora,
                                                "trainer.total_training_steps=3")), progress=False)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["weights/version"] for r in rows] == [1.0, 2.0, 3.0]
    for row in rows:
        assert row["rollout/mismatch_max_abs"] <= 1e-5, row
