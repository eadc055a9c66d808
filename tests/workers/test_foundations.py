"""Keys that used to be accepted and ignored, now honoured: the forward-only passes' micro-batch sizes, the reward
model's padding removal, DAPO's filter metric and its unlimited generation budget; and the CLI's start-up errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from e2e_helpers import make_batch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine
from hybridflow.protocol import DataProto
from hybridflow.trainer.config import load_config
from hybridflow.trainer.rl_trainer import RLTrainer
from hybridflow.workers.reward_model import RewardModelWorker


def count_forwards(engine: FSDPEngine) -> list[int]:
    sizes: list[int] = []
    original = engine._forward

    def forward(rows, **kw):
        sizes.append(len(rows))
        return original(rows, **kw)

    engine._forward = forward
    return sizes


def test_log_prob_passes_use_their_own_micro_batch_size(tiny_model_path):
    """rollout.log_prob_micro_batch_size_per_gpu / log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu size
    the forward-only pass; training keeps its own size. Same log-probs either way."""
    data = make_batch(12, 6, 8, seed=1)
    train_sized = FSDPEngine(EngineConfig(tiny_model_path, role="ref", micro_batch_size_per_gpu=2))
    infer_sized = FSDPEngine(EngineConfig(tiny_model_path, role="ref", micro_batch_size_per_gpu=2,
                                          infer_micro_batch_size_per_gpu=6))
    budget = FSDPEngine(EngineConfig(tiny_model_path, role="ref", micro_batch_size_per_gpu=2,
                                     infer_use_dynamic_bsz=True, infer_max_tokens_per_micro_batch=40))
    calls = [count_forwards(e) for e in (train_sized, infer_sized, budget)]
    outs = [e.compute_log_prob(data, temperature=1.0)["log_probs"] for e in (train_sized, infer_sized, budget)]
    assert calls[0] == [2] * 6 and calls[1] == [6, 6]
    assert len(calls[2]) not in (2, 6) and sum(calls[2]) == 12  # a token budget, neither fixed size
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=0)


def test_reward_model_padding_removal_changes_the_work_not_the_scores(tiny_model_path):
    """reward_model.model.use_remove_padding: length-grouped micro-batches cut to the columns in use; same scores."""
    scores, shapes = {}, {}
    batch = make_batch(7, 10, 6, seed=3)
    for remove in (True, False):
        cfg = load_config([f"reward_model.model.path={tiny_model_path}", "reward_model.enable=true",
                           "reward_model.micro_batch_size_per_gpu=3",
                           f"reward_model.model.use_remove_padding={str(remove).lower()}"])
        worker = RewardModelWorker(cfg)
        torch.manual_seed(0)  # the tiny model has no trained score head: both workers must draw the same one
        worker.init_model()
        scores[remove] = worker.compute_rm_score(batch).batch["rm_scores"]
        shapes[remove] = worker.scorer.forward_shapes  # [rows, width] of each forward
    torch.testing.assert_close(scores[True], scores[False], atol=1e-5, rtol=0)
    assert [w for _, w in shapes[False]] == [16, 16, 16]
    assert sum(r * w for r, w in shapes[True]) < sum(r * w for r, w in shapes[False])


def batch_with(scores, acc, uids):
    b = DataProto.from_dict(
        {"scores": torch.tensor(scores), "acc": torch.tensor(acc),
         "token_level_scores": torch.tensor(scores)[:, None].repeat(1, 2)},
        {"uid": np.array(uids, dtype=object)},
    )
    return b


def test_filter_metric_acc_reads_the_scorers_acc_field():
    b = batch_with([1.0, 0.0, 0.5, 0.5], [1.0, 1.0, 1.0, 0.0], ["a", "a", "b", "b"])
    assert RLTrainer.filter_values(b, "score").tolist() == [1.0, 0.0, 0.5, 0.5]
    assert RLTrainer.filter_values(b, "acc").tolist() == [1.0, 1.0, 1.0, 0.0]  # not the score
    del b.batch["acc"]
    with pytest.raises(ValueError, match="metric=acc needs a scorer"):
        RLTrainer.filter_values(b, "acc")


def test_unlimited_generation_batches_keep_going_until_the_batch_is_full():
    """filter_groups.max_num_gen_batches=0 means no limit (it used to mean one batch)."""
    cfg = load_config(["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0",
                       "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.cfg = cfg
    calls = []

    def generate_and_score_once(prompts, *, salt, metrics, timing):
        calls.append(salt)
        informative = salt >= 6  # the first six batches hold only groups whose samples all score the same
        scores = [1.0, 0.0, 1.0, 0.0] if informative else [1.0, 1.0, 0.0, 0.0]
        return batch_with(scores, scores, [f"{salt}-0", f"{salt}-0", f"{salt}-1", f"{salt}-1"])

    trainer.generate_and_score_once = generate_and_score_once
    trainer.next_prompts = lambda: None
    batch, metrics = trainer.rollout_and_score(None, {})
    assert calls == list(range(7)) and len(batch) == 4 and metrics["dapo/num_gen_batches"] == 7.0


def test_startup_errors_exit_2_with_one_message(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"data_source": "x"}\n')
    out = subprocess.run(
        [sys.executable, "-m", "hybridflow", "train", "--dry-run", f"data.train_files={bad}", f"data.val_files={bad}"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and str(bad) in out.stderr
