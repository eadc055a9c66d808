"""Errors found before the first step (issue 23, item 2): settings checked by validate_config, and what needs the
data, the cluster or the device checked by trainer/preflight.py -- all before any worker starts."""

from __future__ import annotations

import json
import os

import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.data import RLDataset
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


def _jsonl(path, sources) -> str:
    rows = [{"data_source": s, "prompt": [{"role": "user", "content": f"q{i}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": i}}
            for i, s in enumerate(sources)]
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
