"""End to end on Ray with the ecosystem's pieces: a veRL batch reward function (reward_manager=batch) and a
reasoning-gym task as the dataset and scorer."""

from __future__ import annotations

import json
import math

from e2e_helpers import tiny_run_overrides

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training

BATCH_FN = __file__.replace("test_verl_compat_e2e.py", "verl_batch_reward.py")


def _rows(run_dir: str) -> list[dict]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_grpo_with_a_verl_batch_reward_function(ray_session, arithmetic_files, tiny_model_path, tmp_path):
    run_dir, log = str(tmp_path / "run"), tmp_path / "calls.jsonl"
    cfg = load_config(tiny_run_overrides(
        arithmetic_files, tiny_model_path, run_dir, "trainer.backend=ray",
        "reward_model.reward_manager=batch", f"custom_reward_function.path={BATCH_FN}",
        "custom_reward_function.name=compute_score", "+custom_reward_function.reward_kwargs.offset=0.25",
        f"+reward_model.reward_kwargs.log_path={log}",
    ))
    result = run_training(cfg, progress=False)
    assert result.global_step == 2
    rows = _rows(run_dir)
    for row in rows:
        assert row["reward/failures"] == 0
        assert row["critic/score/min"] >= 0.25  # the custom function's reward_kwargs reached it
        assert math.isfinite(row["actor/pg_loss"])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # one call per training batch: train_batch_size 4 prompts x rollout.n 4, the whole batch at once
    assert [c["rows"] for c in calls] == [16, 16] and calls[0]["sources"] == ["hybridflow/arithmetic"]


def test_grpo_on_a_reasoning_gym_task(ray_session, tiny_model_path, tmp_path):
    run_dir = str(tmp_path / "run")
    task = "reasoning_gym:basic_arithmetic?system_prompt=none&size={}&seed={}"
    cfg = load_config(tiny_run_overrides(
        (task.format(16, 1), task.format(8, 2)), tiny_model_path, run_dir, "trainer.backend=ray",
        "data.max_prompt_length=96", "trainer.val_before_train=true",
    ))
    result = run_training(cfg, progress=False)
    assert result.global_step == 2
    rows = _rows(run_dir)
    assert all(r["reward/failures"] == 0 for r in rows if "reward/failures" in r)  # every row scored by the task
    assert "val/reasoning_gym/basic_arithmetic/mean@1" in result.initial_val
