"""End to end: GRPO on the arithmetic task with vLLM as the rollout engine in the actor's process (hybrid engine).

The actor trains in fp32; vLLM generates in bf16, so the reported train-inference mismatch is small but not zero.
After every update the new weights go into vLLM (no restart) — if they did not, the mismatch would grow with the
number of updates instead of staying at the bf16 level.
"""

from __future__ import annotations

import json
import math

from e2e_helpers import tiny_run_overrides

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training


def test_grpo_with_vllm_rollout(arithmetic_files, model_path, tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(
        arithmetic_files, model_path, run_dir, "trainer.backend=local", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=bf16", "trainer.total_training_steps=3", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.rollout.engine_kwargs={kv_cache_space_gib: 1}",
    ))
    result = run_training(cfg, progress=False)
    assert result.global_step == 3
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    mismatch = [r["rollout/mismatch_mean_abs"] for r in rows]
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]) and row["timing/sync_weights"] > 0
    # bf16 rollout vs fp32 actor: ~1e-2, never 0, and it does not drift upwards as the weights change (lr is large).
    assert all(1e-4 < m < 0.1 for m in mismatch), mismatch
    assert mismatch[-1] < 3 * mismatch[0], mismatch


def test_a_tensor_parallel_vllm_rollout_leaves_no_shared_memory_and_runs_again(ray_session, arithmetic_files,
                                                                               model_path, tmp_path):
    """vLLM's CPU tensor-parallel group keeps shared-memory segments under a name that is the same in every run (the
    external launcher's); left in /dev/shm they failed the next run on the machine at start-up ("create shm in
    SHMManager failed. errno: 17"). The rollout drops their names once every rank has mapped them."""
    import os

    def shm() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if "cpushm" in n or n.startswith("psm_")}

    before = shm()
    for run in ("first", "second"):
        cfg = load_config(tiny_run_overrides(
            arithmetic_files, model_path, str(tmp_path / run), "trainer.backend=ray", "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "trainer.total_training_steps=1", "actor_rollout_ref.rollout.engine_kwargs={kv_cache_space_gib: 1}",
        ))
        assert run_training(cfg, progress=False).global_step == 1
        assert shm() <= before, shm() - before


def test_multi_turn_episodes_on_a_tensor_parallel_vllm_rollout(ray_session, model_path, tmp_path):
    """veRL's multi-turn scripts: vLLM with tensor_model_parallel_size=2 under the agent loop. The group's first rank
    runs the episodes; the other replays its engine.generate batches, so vLLM's two ranks take every call together."""
    from hybridflow.data.tasks.agent_tasks import generate_guess_number_task

    files = generate_guess_number_task(str(tmp_path / "data"), num_train=8, num_val=4, num_sft_games=1)
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(
        (files["train"], files["val"]), model_path, run_dir, "trainer.backend=ray", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.engine_kwargs={kv_cache_space_gib: 1}",
        "data.return_raw_chat=true", "data.max_prompt_length=48", "data.max_response_length=64",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.environment=guess_number",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=6", "trainer.total_training_steps=1",
    ))
    assert run_training(cfg, progress=False).global_step == 1
    row = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")][-1]
    assert row["agent/assistant_turns/mean"] > 1 and 0 < row["agent/observation_token_share/mean"] < 1
    assert math.isfinite(row["actor/pg_loss"]) and row["rollout/mismatch_mean_abs"] < 0.1
