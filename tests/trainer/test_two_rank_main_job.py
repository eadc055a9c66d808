"""The main job's preset on 2 data-parallel ranks for 10 steps (the run a new user tries first after `make demo`).

It would have caught two bugs: each rank returned responses as wide as its own longest one, so gathering the ranks'
chunks failed at a random step (DataProtoError: concat ... row shape); and samples.jsonl paired prompts and scores
with another row's response once balance_batch reordered the rows. Here every written sample is checked against its
own prompt: the prompt's arithmetic gives the ground truth, and the response re-scored against it gives the score.
"""

from __future__ import annotations

import json
import os
import re

from hybridflow.rewards.scorers.arithmetic import compute_score
from hybridflow.trainer.main import train_main

QUESTION = re.compile(r"(\d+(?:[+\-*]\d+)+)")


def test_main_job_preset_on_two_ranks_for_ten_steps(ray_session, tmp_path):
    run_dir = str(tmp_path / "run")
    result = train_main([
        "trainer.n_gpus_per_node=2", "trainer.total_training_steps=10", "trainer.test_freq=-1",
        "trainer.val_before_train=False", f"trainer.default_local_dir={run_dir}", "trainer.log_samples_freq=1",
        "trainer.save_freq=0", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
    ])
    assert result.global_step == 10

    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 11))
    for r in steps:
        assert r["balance/max_over_mean_tokens"] >= 1.0  # balance_batch's own metric is logged
        assert 0.0 < r["perf/mfu"] < 1.0, r["perf/mfu"]

    samples = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    assert {s["step"] for s in samples} == set(range(1, 11))
    for s in samples:
        question = QUESTION.findall(s["prompt"])[-1]
        assert str(eval(question)) == str(s["ground_truth"]), s
        assert compute_score(s["response"], s["ground_truth"]) == s["score"], s
    assert any(s["score"] == 1.0 for s in samples) and any(s["score"] == 0.0 for s in samples)
