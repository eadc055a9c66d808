"""The rollout as a WorkerGroup of its own (actor_rollout_ref.hybrid_engine=false), on real Ray: its weights come
over the transfer group after every update, each transfer carries a version, and the overlapped modes
(one_step_off, async) train, resume and survive a rollout rank's death."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

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


def comparable(row: dict) -> dict:
    """A metrics row without what depends on the clock."""
    return {k: v for k, v in row.items() if not k.startswith(("timing", "perf/"))}


def test_one_step_off_trains_one_version_behind_and_resumes_bitwise(ray_session, arithmetic_files, tiny_model_path,
                                                                      tmp_path):
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    # decoupled PPO: old log-probs recomputed by the actor, truncated weights pi_old / pi_rollout on every token
    mode = ("trainer.rollout_mode=one_step_off", "trainer.total_training_steps=4",
            "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=1.5")
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, full, *SEPARATE, *mode,
                                         "trainer.save_freq=2"))
    assert run_training(cfg, progress=False).global_step == 4
    rows = rows_of(full)
    # step 1 trains on the initial policy's samples; later steps on samples one version old, re-scored by the actor
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert rows[0]["rollout/mismatch_max_abs"] <= 1e-5
    for r in rows:
        assert 0 < r["actor/rollout_correction/is_weight_mean"] <= r["actor/rollout_correction/is_weight_max"] <= 1.5
    # old samples: the actor has moved on (by weight decay alone here: the tiny model's groups often tie)
    assert all(r["rollout/mismatch_max_abs"] > 2 * rows[0]["rollout/mismatch_max_abs"] for r in rows[1:])
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, resumed, *SEPARATE, *mode,
                                         f"trainer.resume_mode={full}/global_step_2"))
    assert run_training(cfg, progress=False).global_step == 4
    again = rows_of(resumed)
    assert [r["training/global_step"] for r in again] == [3, 4]
    assert [comparable(r) for r in again] == [comparable(r) for r in rows[2:]]


def test_async_replaces_a_dead_rollout_rank_and_resumes_without_losing_prompts(ray_session, arithmetic_files,
                                                                                tiny_model_path, tmp_path):
    import torch

    first, resumed = str(tmp_path / "first"), str(tmp_path / "resumed")
    mode = ("trainer.rollout_mode=async", "trainer.total_training_steps=4", "trainer.rollout_buffer_batches=2",
            "trainer.max_staleness=2")
    # rollout rank 1 is killed while generating the third batch: the group is replaced and the batch regenerated
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, first, *SEPARATE, *mode,
                                         "trainer.save_freq=2", "trainer.fault_injection=generate_sequences:1:3"))
    result = run_training(cfg, progress=False)
    assert result.global_step == 4 and result.restarts == 0
    rows = rows_of(first)
    assert rows[-1]["async/replaced_rollout_ranks"] == 1.0
    assert all(r["rollout/staleness_max"] <= 2 for r in rows)
    assert [r["weights/version"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    # the checkpoint's buffer and loader position agree: every prompt taken from the loader was trained, dropped
    # (counted) or is in the buffer, exactly once
    state = torch.load(f"{first}/global_step_2/rollout_state.pt", weights_only=False)
    trainer_state = json.load(open(f"{first}/global_step_2/trainer_state.json"))
    taken = trainer_state["dataloader"]["batches_done"]
    assert taken == state["produced"] == 2 + state["counts"]["dropped_stale_batches"] + len(state["buffer"])
    buffered = [int(i) for prompts, _ in state["buffer"] for i in prompts.non_tensor_batch["index"]]
    assert len(set(buffered)) == len(buffered)
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, resumed, *SEPARATE, *mode,
                                         f"trainer.resume_mode={first}/global_step_2"))
    assert run_training(cfg, progress=False).global_step == 4
    again = rows_of(resumed)
    assert [r["weights/version"] for r in again] == [3.0, 4.0]


def test_async_drops_samples_older_than_max_staleness(ray_session, arithmetic_files, tiny_model_path, tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, *SEPARATE,
                                         "trainer.rollout_mode=async", "trainer.max_staleness=0",
                                         "trainer.rollout_buffer_batches=2", "trainer.total_training_steps=3"))
    assert run_training(cfg, progress=False).global_step == 3
    rows = rows_of(run_dir)
    assert all(r["rollout/staleness_max"] == 0.0 for r in rows)  # nothing older than the bound was trained
    assert rows[-1]["async/dropped_stale_samples"] > 0  # the buffered batch generated before each update went
    assert rows[-1]["async/dropped_stale_samples"] == 16 * rows[-1]["async/dropped_stale_batches"]


def test_actor_and_rollout_on_two_simulated_nodes(arithmetic_files, tiny_model_path, tmp_path):
    """Both rollout modes that move weights across nodes, one after the other on one two-node cluster."""
    script = Path(__file__).with_name("two_node_rollout_check.py")
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(script.parent.parent)}  # its own cluster; e2e_helpers
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), tiny_model_path, *arithmetic_files, "sync,one_step_off"],
        capture_output=True, text=True, timeout=600, env=env, cwd=script.parent,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert [r["mode"] for r in reports] == ["sync", "one_step_off"]
    for report in reports:
        assert report["nodes"] == 2
        assert len(report["actor"]) == len(report["rollout"]) == 1 and report["actor"] != report["rollout"]
        rows = report["rows"]
        assert [r["weights/version"] for r in rows] == [1.0, 2.0, 3.0]
        assert all(r["perf/weight_transfer_MBps"] > 0 for r in rows)
        if report["mode"] == "sync":  # every step samples from the weights just sent across the nodes
            assert all(r["rollout/mismatch_max_abs"] <= 1e-5 for r in rows)
        else:
            assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]


def test_the_cli_sizes_its_own_cluster_for_the_rollout_group_and_async_ppo_gets_values_from_the_critic(
        arithmetic_files, tiny_model_path, tmp_path):
    """`hybridflow train` as a user runs it (no Ray yet: the CLI starts its own cluster): 2 actor ranks with their
    critic and a rollout group of 2 are more processes than this machine's CPUs. The cluster used to be sized for the
    actor ranks alone, and the rollout's placement group waited 120 s and failed. Async PPO: the values come from
    the critic when the batch is trained, not when it was generated."""
    run_dir = str(tmp_path / "run")
    overrides = tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, *SEPARATE, "trainer.n_gpus_per_node=2",
                                   "trainer.rollout_mode=async", "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3")
    proc = subprocess.run([sys.executable, "-m", "hybridflow", "train", *overrides], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = rows_of(run_dir)
    assert [r["weights/version"] for r in rows] == [1.0, 2.0]
    assert all(r["rollout/mismatch_max_abs"] <= 1e-5 for r in rows if r["rollout/staleness_max"] == 0.0)
    for row in rows:
        assert math.isfinite(row["critic/vf_loss"]) and row["rollout/staleness_max"] <= 1


def test_local_cpu_slots_count_the_rollout_group_of_its_own():
    from hybridflow.trainer.main import local_cpu_slots

    colocated = load_config(["trainer.n_gpus_per_node=2"])
    assert local_cpu_slots(colocated, roles_per_rank=2) == 4
    separate = load_config(["trainer.n_gpus_per_node=2", *SEPARATE[1:3]])
    assert local_cpu_slots(separate, roles_per_rank=1) == 4
