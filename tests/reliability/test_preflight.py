"""Errors found before the first step (issue 23, item 2): settings checked by validate_config, and what needs the
data, the cluster or the device checked by trainer/preflight.py -- all before any worker starts."""

from __future__ import annotations

import json
import os
import sys

import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.data import RLDataset
from hybridflow.data.schema import DataConfigError
from hybridflow.engines.tiny import build_char_tokenizer
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main import run_training
from hybridflow.trainer.preflight import preflight_errors


@pytest.mark.parametrize(("override", "needle"), [
    ("actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.optim.lr=0 must be > 0"),
    ("actor_rollout_ref.actor.optim.lr=-1e-5", "actor_rollout_ref.actor.optim.lr=-1e-05 must be > 0"),
    ("trainer.total_training_steps=0", "trainer.total_training_steps=0 must be >= 1"),
    ("trainer.total_training_steps=-3", "trainer.total_training_steps=-3 must be >= 1"),
    ("trainer.n_gpus_per_node=0", "trainer.n_gpus_per_node=0 must be >= 1"),
])
def test_settings_that_fail_later_fail_at_load(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    assert needle in str(e.value)


def test_critic_lr_is_checked_only_when_a_critic_runs():
    load_config(["critic.optim.lr=0"])  # grpo: no critic, nothing to complain about
    with pytest.raises(ConfigError, match=r"critic\.optim\.lr=0 must be > 0"):
        load_config(["critic.optim.lr=0", "algorithm.adv_estimator=gae"])


def test_group_estimator_with_one_response_per_prompt():
    cfg = load_config(["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"])
    [msg] = preflight_errors(cfg)
    assert "algorithm.adv_estimator=rloo" in msg and "actor_rollout_ref.rollout.n >= 2" in msg
    assert preflight_errors(load_config(["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=2"])) == []
    assert preflight_errors(load_config(["algorithm.adv_estimator=reinforce_plus_plus",
                                         "actor_rollout_ref.rollout.n=1"])) == []  # no groups needed


def _jsonl(path, sources, agent_names=None) -> str:
    rows = [{"data_source": s, "prompt": [{"role": "user", "content": f"q{i}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": i}}
            for i, s in enumerate(sources)]
    for r, name in zip(rows, agent_names or []):
        r["agent_name"] = name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_data_sources_without_a_scorer(tmp_path):
    tok = build_char_tokenizer()
    val = RLDataset(_jsonl(tmp_path / "val.jsonl", ["openai/gsm8k", "mystery/bench", "mystery/bench"]), tok,
                    name="val")
    cfg = load_config(["actor_rollout_ref.rollout.n=2"])
    [msg] = preflight_errors(cfg, val_ds=val)
    assert "val data" in msg and "val.jsonl" in msg and "'mystery/bench' (2 rows)" in msg
    assert "custom_reward_function.path=" in msg
    cfg.custom_reward_function.path = "any.py"  # a custom function scores every source
    assert preflight_errors(cfg, val_ds=val) == []


def test_agent_names_in_the_data_that_cannot_run(tmp_path):
    """veRL's per-row agent_name: the two loops hybridflow runs pass; others, and tool_agent rows without
    multi_turn, are named with their row counts."""
    tok = build_char_tokenizer()
    ds = RLDataset(_jsonl(tmp_path / "train.jsonl", ["openai/gsm8k"] * 5,
                          ["tool_agent", "tool_agent", "react_agent", "single_turn_agent", None]), tok, name="train")
    cfg = load_config(["actor_rollout_ref.rollout.n=2"])
    unknown, needs_multi_turn = preflight_errors(cfg, train_ds=ds)
    assert "train data" in unknown and "'react_agent' (1 rows)" in unknown and "multi_turn.environment" in unknown
    assert "2 rows have agent_name 'tool_agent'" in needs_multi_turn and "multi_turn.enable=true" in needs_multi_turn
    plain = RLDataset(_jsonl(tmp_path / "plain.jsonl", ["openai/gsm8k"] * 2, ["single_turn_agent"]), tok, name="val")
    assert preflight_errors(cfg, val_ds=plain) == []
    with pytest.raises(DataConfigError, match=r"row 0, column 'agent_name': expected a string"):
        RLDataset(_jsonl(tmp_path / "bad.jsonl", ["openai/gsm8k"], [3]), tok, name="train")
    with pytest.raises(ConfigError, match=r"default_agent_loop='react_agent': hybridflow runs veRL's single_turn"):
        load_config(["actor_rollout_ref.rollout.agent.default_agent_loop=react_agent"])
    with pytest.raises(ConfigError, match=r"default_agent_loop=tool_agent needs .*multi_turn\.enable=true"):
        load_config(["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"])


def test_run_with_an_unscorable_validation_set_stops_before_any_step(arithmetic_files, tiny_model_path, tmp_path):
    val = _jsonl(tmp_path / "val.jsonl", ["hybridflow/arithmetic", "nobody/knows"])
    run_dir = tmp_path / "run"
    cfg = load_config(tiny_run_overrides((arithmetic_files[0], val), tiny_model_path, str(run_dir),
                                         "trainer.backend=local"))
    with pytest.raises(ConfigError, match=r"cannot start the run:\n  - val data .*'nobody/knows' \(1 rows\)"):
        run_training(cfg, progress=False)
    assert not os.path.exists(run_dir / "metrics.jsonl")


def test_cluster_and_device_checks(ray_session):
    res = ray_session.cluster_resources()  # the real shape: "node:<ip>" per node, CPU, memory, ...
    cfg = load_config(["trainer.nnodes=4", "actor_rollout_ref.rollout.n=2"])
    [msg] = preflight_errors(cfg, cluster_resources=res)
    assert "trainer.nnodes=4 but the Ray cluster has 1 node(s)" in msg
    cfg = load_config(["trainer.device=cuda", "actor_rollout_ref.rollout.n=2"])
    no_gpu = {k: v for k, v in res.items() if k != "GPU"}
    [msg] = preflight_errors(cfg, cluster_resources=no_gpu)
    assert "trainer.device=cuda but no GPU is visible" in msg and "trainer.device=cpu" in msg
    assert preflight_errors(cfg, cluster_resources={**no_gpu, "GPU": 1.0}) == []


def test_a_checkpoint_to_resume_from_that_is_missing_or_cut_off_stops_the_run_before_it_starts(
        arithmetic_files, tiny_model_path, tmp_path):
    cut = tmp_path / "old" / "global_step_3"
    cut.mkdir(parents=True)  # no COMPLETE marker: a save that was cut off
    cases = [
        (["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'nowhere'}"],
         r"trainer\.resume_from_path='.*nowhere' is neither auto, disable nor an existing checkpoint folder"),
        ([f"trainer.resume_mode={cut}"], r".*global_step_3 is not a complete checkpoint \(no COMPLETE marker\)"),
    ]
    for extra, needle in cases:
        run_dir = tmp_path / "run"
        cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, str(run_dir), "trainer.backend=local",
                                             *extra))
        with pytest.raises(ConfigError, match=r"cannot start the run:\n  - " + needle):
            run_training(cfg, progress=False)
        assert not os.path.exists(run_dir / "metrics.jsonl")


def test_a_logger_whose_package_is_missing_stops_the_run_and_the_dry_run_before_they_start(
        arithmetic_files, tiny_model_path, tmp_path, monkeypatch):
    from hybridflow.trainer.dry_run import dry_run

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    run_dir = tmp_path / "run"
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, str(run_dir), "trainer.backend=ray",
                                         "trainer.logger=[console,wandb]"))
    needle = r"cannot start the run:\n  - logger 'wandb' needs the 'wandb' package.*remove 'wandb' from trainer\.logger"
    with pytest.raises(ConfigError, match=needle):
        dry_run(cfg)
    with pytest.raises(ConfigError, match=needle):
        run_training(cfg, progress=False)
    assert not os.path.exists(run_dir / "metrics.jsonl")
