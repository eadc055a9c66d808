"""veRL's reward_model.launch_reward_fn_async: the rule scores are computed in the trainer's reward thread while the
step's log-prob passes run, and joined before the advantages. The passes do not wait for them (the reference pass
starts before the slow scorer's last score), and the run is the synchronous run's, step for step."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.engines.fsdp_engine import FSDPEngine
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main import run_training
from hybridflow.trainer.rl_trainer import RLTrainer

SLOW_REWARD = str(Path(__file__).parent / "slow_reward.py")


def _run(files, model_path: str, run_dir: str, *extra: str) -> list[dict]:
    cfg = load_config(tiny_run_overrides(
        files, model_path, run_dir, "trainer.backend=local", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.recompute_old_log_prob=always", f"custom_reward_function.path={SLOW_REWARD}",
        "custom_reward_function.name=slow_exact", *extra))
    assert run_training(cfg, progress=False).global_step == 2
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def test_the_passes_run_while_the_rule_scores_are_computed(arithmetic_files, tiny_model_path, tmp_path, monkeypatch):
    events: list[tuple[str, float, str]] = []  # (what, monotonic time, thread)

    def record(name, method):
        def wrapped(self, *args, **kwargs):
            events.append((name, time.monotonic(), threading.current_thread().name))
            out = method(self, *args, **kwargs)
            events.append((name + " done", time.monotonic(), threading.current_thread().name))
            return out
        return wrapped

    for cls, name in ((RLTrainer, "score_in_background"), (RLTrainer, "rule_scores"), (RLTrainer, "join_scores"),
                      (FSDPEngine, "compute_log_prob")):
        monkeypatch.setattr(cls, name, record(name, getattr(cls, name)))
    background = _run(arithmetic_files, tiny_model_path, str(tmp_path / "async"),
                      "reward_model.launch_reward_fn_async=true")
    scorer_threads = {thread for what, _, thread in events if what == "rule_scores"}
    assert scorer_threads and all(t.startswith("hybridflow-reward") for t in scorer_threads), scorer_threads
    for step in range(2):
        submitted = [t for what, t, _ in events if what == "score_in_background"][step]
        scored = [t for what, t, _ in events if what == "rule_scores done"][step]
        joined = [t for what, t, _ in events if what == "join_scores"][step]
        passes = [t for what, t, _ in events if what == "compute_log_prob" and submitted < t < joined]
        # the old-log-prob and reference passes started after the scoring did and before it was done (16 samples
        # of 0.05 s each in the scoring worker): they did not wait for the scores
        assert len(passes) == 2 and all(t < scored for t in passes), (submitted, passes, scored)
    monkeypatch.undo()
    inline = _run(arithmetic_files, tiny_model_path, str(tmp_path / "sync"))
    for a, b in zip(background, inline):  # the same run: same scores on the same rows, the same update
        for key in ("reward/score_mean", "critic/advantages/mean", "actor/pg_loss", "actor/grad_norm"):
            assert a[key] == b[key], (key, a[key], b[key])


def test_dynamic_sampling_needs_its_scores_at_once():
    with pytest.raises(ConfigError, match=r"launch_reward_fn_async=true with algorithm\.filter_groups\.enable=true"):
        load_config(["reward_model.launch_reward_fn_async=true", "algorithm.filter_groups.enable=true",
                     "actor_rollout_ref.rollout.n=4"])
