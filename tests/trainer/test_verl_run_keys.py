"""veRL run keys honoured as veRL means them: trainer.log_val_generations, data.return_raw_chat,
trainer.resume_mode=resume_path + trainer.resume_from_path."""

from __future__ import annotations

import json
import os

import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main import build_datasets, run_training


def test_val_generations_go_to_samples_and_resume_path_resumes(arithmetic_files, tiny_model_path, tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    base = tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local",
                              "trainer.save_freq=1", "trainer.log_val_generations=3", "trainer.val_before_train=true", "trainer.test_freq=1",
                              "data.val_max_samples=8")
    run_training(load_config([*base, "trainer.total_training_steps=1"]), progress=False)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    val = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in val] == [0, 0, 0, 1, 1, 1]  # before training and after the last step, 3 each
    assert all(r["prompt"] and "ground_truth" in r for r in val)

    ckpt = os.path.join(run_dir, "global_step_1")
    resumed = load_config([*base, "trainer.total_training_steps=2", "trainer.resume_mode=resume_path",
                           f"trainer.resume_from_path={ckpt}"])
    with caplog.at_level("WARNING"):
        assert run_training(resumed, progress=False).global_step == 2
    assert any("resuming from" in r.message and "global_step_1" in r.message for r in caplog.records)
    with pytest.raises(ConfigError, match=r"resume_mode=resume_path needs trainer\.resume_from_path"):
        load_config(["trainer.resume_mode=resume_path"])


def test_return_raw_chat_decides_whether_the_chat_rides_along(arithmetic_files, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for flag in (False, True):
        cfg = load_config([f"data.train_files={arithmetic_files[0]}", f"data.val_files={arithmetic_files[1]}",
                           f"data.return_raw_chat={str(flag).lower()}", "data.train_batch_size=4",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
        train, _ = build_datasets(cfg, tok)
        batch = next(train.iter_batches())
        assert ("raw_prompt" in batch.non_tensor_batch) is flag
        if flag:
            assert batch.non_tensor_batch["raw_prompt"][0][-1]["role"] == "user"


def test_nccl_timeout_is_the_process_group_timeout(arithmetic_files, tiny_model_path, tmp_path, monkeypatch):
    from hybridflow.single_controller.worker import Worker

    base = tiny_run_overrides(arithmetic_files, tiny_model_path, str(tmp_path / "run"), "trainer.backend=local",
                              "trainer.total_training_steps=1")
    with pytest.raises(ConfigError, match="nccl_timeout=0 must be a positive"):
        load_config([*base, "actor_rollout_ref.nccl_timeout=0"])
    seen = []
    original = Worker.init_distributed
    monkeypatch.setattr(Worker, "init_distributed", lambda self, timeout_s=600.0: (seen.append(timeout_s),
                                                                                    original(self, timeout_s))[1])
    run_training(load_config([*base, "actor_rollout_ref.nccl_timeout=1234"]), progress=False)
    assert seen and all(t == 1234.0 for t in seen)
