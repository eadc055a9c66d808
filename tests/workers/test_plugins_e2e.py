"""A user's rollout engine named by import path runs one GRPO step on Ray, with no change to hybridflow."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.engines.rollout.registry import ROLLOUT_ENGINES
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main import run_training

PLUGIN = f"{Path(__file__).parent / 'toy_rollout_plugin.py'}:ToyRollout"


def test_a_rollout_engine_by_import_path_runs_a_grpo_step_on_ray(ray_session, arithmetic_files, tiny_model_path,
                                                                  tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(
        arithmetic_files, tiny_model_path, run_dir, f"actor_rollout_ref.rollout.name={PLUGIN}",
        "+actor_rollout_ref.rollout.engine_kwargs.vocab_limit=16", "trainer.total_training_steps=1",
    ))
    try:
        result = run_training(cfg, progress=False)
    finally:
        forget_plugin()
    assert result.global_step == 1
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    step = [r for r in rows if r.get("step") == 1][-1]
    assert step["response_length/mean"] > 0  # the toy engine's random-length responses reached the update
    assert "actor/pg_loss" in step


def test_a_plugin_option_it_does_not_take_is_a_config_error():
    with pytest.raises(ConfigError, match=r"engine_kwargs\.beam_width.*options: \['vocab_limit'\]"):
        load_config([f"actor_rollout_ref.rollout.name={PLUGIN}", "+actor_rollout_ref.rollout.engine_kwargs.beam_width=4"])
    forget_plugin()


def forget_plugin() -> None:
    if PLUGIN in ROLLOUT_ENGINES:
        ROLLOUT_ENGINES.remove(PLUGIN)
