"""Overrides for small end-to-end RL runs on the arithmetic task (shared by the worker and trainer tests)."""

from __future__ import annotations


def tiny_run_overrides(files: tuple[str, str], model_path: str, run_dir: str, *extra: str) -> list[str]:
    train, val = files
    return [
        f"data.train_files={train}", f"data.val_files={val}", f"actor_rollout_ref.model.path={model_path}",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.total_training_steps=2", f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=0",
        "trainer.logger=[jsonl]", "trainer.progress_bar=false", "reward_model.num_workers=1",
        "trainer.num_threads_per_worker=1", *extra,
    ]
