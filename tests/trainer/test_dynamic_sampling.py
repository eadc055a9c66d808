"""DAPO's dynamic sampling (trainer/dynamic_sampling.py): zero-variance groups dropped, generation repeated from fresh
prompts until data.train_batch_size groups are kept or max_num_gen_batches is spent, everything counted; and
data.gen_batch_size as veRL's DAPO recipe passes it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from e2e_helpers import tiny_run_overrides

from hybridflow.protocol import DataProto
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.dynamic_sampling import fill_step_with_informative_groups

N = 2


def scored(attempt: int, group_scores: list[list[float]]) -> DataProto:
    """A scored generation batch: one group of N rows per entry, rows of a group adjacent (as the rollout makes)."""
    scores = [s for g in group_scores for s in g]
    uids = [f"{attempt}-{i}" for i, g in enumerate(group_scores) for _ in g]
    return DataProto.from_dict({"scores": torch.tensor(scores)}, {"uid": np.array(uids, dtype=object)})


def run(batches: list[list[list[float]]], groups_needed: int, max_gen_batches: int):
    calls = []

    def generate_and_score(prompts, attempt):
        calls.append((prompts, attempt))
        return scored(attempt, batches[attempt])

    fresh = iter(range(1, 100))
    batch, metrics = fill_step_with_informative_groups(
        0, lambda: next(fresh), generate_and_score, lambda b: b.batch["scores"].numpy(),
        groups_needed=groups_needed, n=N, max_gen_batches=max_gen_batches,
    )
    return batch, metrics, calls


def test_zero_variance_groups_are_dropped_and_generation_repeats_on_fresh_prompts():
    batches = [
        [[1, 1], [0, 1], [0, 0]],  # one informative group of three
        [[0, 0], [1, 1], [1, 1]],  # none
        [[1, 0], [1, 1], [0, 1]],  # two: enough (3 wanted); the second one is cut off
    ]
    batch, metrics, calls = run(batches, groups_needed=3, max_gen_batches=5)
    assert [c[0] for c in calls] == [0, 1, 2]  # the first prompts, then a fresh loader batch per attempt
    assert batch.non_tensor_batch["uid"].tolist() == ["0-1", "0-1", "2-0", "2-0", "2-2", "2-2"]
    assert batch.batch["scores"].tolist() == [0, 1, 1, 0, 0, 1]
    assert metrics == {
        "dapo/num_gen_batches": 3.0, "dapo/generated_groups": 9.0, "dapo/kept_groups": 3.0,
        "dapo/dropped_groups": 6.0, "dapo/kept_group_fraction": 3 / 9, "dapo/topped_up_groups": 0.0,
    }


def test_budget_spent_tops_up_with_filtered_groups_counted_and_warned(caplog):
    batches = [[[1, 1], [0, 1]], [[0, 0], [0, 0]]]
    with caplog.at_level("WARNING"):
        batch, metrics, calls = run(batches, groups_needed=3, max_gen_batches=2)
    assert len(calls) == 2 and len(batch) == 3 * N  # exactly the step's rows, whole groups only
    assert batch.non_tensor_batch["uid"].tolist() == ["0-1", "0-1", "0-0", "0-0", "1-0", "1-0"]
    assert metrics["dapo/topped_up_groups"] == 2.0 and metrics["dapo/kept_groups"] == 1.0
    assert "1 of 3 groups had non-identical rewards after 2 generation batches" in caplog.text


def test_no_limit_keeps_generating_until_full():
    batches = [[[1, 1]]] * 6 + [[[0, 1]]]
    batch, metrics, calls = run(batches, groups_needed=1, max_gen_batches=0)
    assert len(calls) == 7 and metrics["dapo/num_gen_batches"] == 7.0 and metrics["dapo/topped_up_groups"] == 0.0
    assert batch.non_tensor_batch["uid"].tolist() == ["6-0", "6-0"]


@pytest.mark.parametrize("overrides, match", [
    (["data.gen_batch_size=12"], r"data.gen_batch_size=12 differs from data.train_batch_size=8.*filter_groups.enable"),
    (["data.gen_batch_size=2", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=3"],
     r"data.gen_batch_size=2 x algorithm.filter_groups.max_num_gen_batches=3 prompts can never fill"),
    (["data.gen_batch_size=0", "algorithm.filter_groups.enable=true"], r"data.gen_batch_size=0 must be >= 1"),
])
def test_gen_batch_size_errors_name_the_keys(overrides, match):
    base = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=2"]
    with pytest.raises(ConfigError, match=match):
        load_config(base + overrides)


def test_gen_batch_size_equal_to_the_step_needs_no_filter():
    cfg = load_config(["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "data.gen_batch_size=8"])
    assert cfg.data.gen_batch_size == 8


def test_dapo_run_with_gen_batch_size_reads_several_loader_batches_per_step(arithmetic_files, tiny_model_path, tmp_path):
    """veRL's DAPO recipe keys end to end: a loader batch is gen_batch_size prompts, each step trains on exactly
    train_batch_size groups, the counters are logged, and the loader position saved counts every batch drawn."""
    from hybridflow.trainer.main import run_training

    run_dir = str(tmp_path / "dapo")
    cfg = load_config(tiny_run_overrides(
        arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local", "trainer.save_freq=2",
        "data.gen_batch_size=6", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=3", "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4", "+reward_model.reward_kwargs.max_resp_len=8",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
    ))
    result = run_training(cfg, progress=False)
    assert result.global_step == 2
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    drawn = 0
    for row in rows:
        gens, kept, dropped = row["dapo/num_gen_batches"], row["dapo/kept_groups"], row["dapo/dropped_groups"]
        assert 1 <= gens <= 3 and kept + dropped == 6 * gens  # every generated group is counted once
        assert kept >= 4 or kept + row["dapo/topped_up_groups"] == 4  # the step holds exactly 4 groups
        assert row["response_length/mean"] > 0
        drawn += int(gens)
    from hybridflow.trainer.checkpoint import CheckpointManager

    ckpt = CheckpointManager(run_dir, None)
    loader = ckpt.read_trainer_state(ckpt.latest())["dataloader"]
    # 128 training prompts = 21 loader batches of 6: both steps stay in epoch 0, and the saved position counts every
    # generation batch drawn, so a resume continues after the last one
    assert loader["batch_size"] == 6 and loader["epoch"] == 0 and loader["batches_done"] == drawn


def test_batches_of_different_prompt_widths_are_left_padded_before_concat():
    from hybridflow.trainer.dynamic_sampling import left_pad_to_common_prompt_width

    def gen_batch(p: int) -> DataProto:
        prompts = torch.full((2, p), 5)
        prompts[0, 0] = 9  # pad id 9 at the row's masked left end
        mask = torch.ones(2, p + 3, dtype=torch.long)
        mask[0, 0] = 0
        return DataProto.from_dict({"prompts": prompts, "input_ids": torch.cat([prompts, torch.ones(2, 3, dtype=torch.long)], 1),
                                    "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                                    "responses": torch.ones(2, 3, dtype=torch.long)})

    narrow, wide = gen_batch(3), gen_batch(5)
    padded = left_pad_to_common_prompt_width([narrow, wide])
    merged = DataProto.concat(padded)
    assert merged.batch["input_ids"].shape == (4, 8) and merged.batch["prompts"].shape == (4, 5)
    assert merged.batch["attention_mask"][:2].sum().item() == narrow.batch["attention_mask"].sum().item()
    assert merged.batch["input_ids"][1, :2].tolist() == [9, 9]  # the batch's own pad id, masked out
    assert narrow.batch["prompts"].shape == (2, 3) and padded[1] is wide  # callers' batches untouched
