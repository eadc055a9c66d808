"""The rollout as a WorkerGroup of its own (actor_rollout_ref.hybrid_engine=false), on real Ray: its weights come
over the transfer group after every update, each transfer carries a version, and the overlapped modes
(one_step_off, async) train, resume and survive a rollout rank's death."""

from __future__ import annotations

import json
import math

from e2e_helpers import tiny_run_overrides

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training

SEPARATE = ("trainer.backend=ray", "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.update_weights_bucket_megabytes=1")


def rows_of(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]


def test_sync_separate_rollout_matches_actor_after_every_transfer(ray_session, arithmetic_files, tiny_model_path,
                                                                   tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, *SEPARATE,
                                         "trainer.total_training_steps=3"))
    result = run_training(cfg, progress=False)
    assert result.global_step == 3
    rows = rows_of(run_dir)
    assert [r["weights/version"] for r in rows] == [1.0, 2.0, 3.0]
    for row in rows:
        # on-policy: the update's first forward re-scores the rollout's tokens under the weights just transferred
        assert row["rollout/mismatch_mean_abs"] <= 1e-5 and row["rollout/mismatch_max_abs"] <= 1e-5
        assert row["rollout/staleness_max"] == 0.0
        assert row["perf/weight_transfer_MBps"] > 0 and math.isfinite(row["timing/weight_transfer"])
        assert row["weights/buckets"] >= 1
