"""`hybridflow train --dry-run`: everything a run checks before its first step, without starting Ray or a worker.

It runs the same builders as the real run (config validation, defaults, datasets, reward function) and, instead of
the model weights, loads the model's config and tokenizer. What it reports: the resolved config, the plan derived
from it (steps, which passes run, which engines), and the data it read. Any problem raises the run's own error.
"""

from __future__ import annotations

from typing import Any

from hybridflow.trainer.config import HybridFlowConfig, to_dict

__all__ = ["dry_run"]


def dry_run(cfg: HybridFlowConfig) -> dict[str, Any]:
    """Validate `cfg` as `run_training` would, up to its first step; returns {"config": ..., "plan": ...}."""
    from transformers import AutoConfig

    from hybridflow.algorithms import get_advantage_estimator
    from hybridflow.engines.rollout.registry import get_rollout_engine, rollout_engine_kwargs
    from hybridflow.trainer.config import ConfigError
    from hybridflow.trainer.main import (
        _raise_preflight,
        build_datasets,
        build_reward_fn,
        load_policy_files,
        load_reward_function,
        resolve_defaults,
        total_steps_of,
    )
    from hybridflow.trainer.preflight import preflight_errors
    from hybridflow.trainer.rl_trainer import is_on_policy
    from hybridflow.trainer.run_dir import prepare_run_dir

    cfg = resolve_defaults(cfg)
    arr, alg = cfg.actor_rollout_ref, cfg.algorithm
    path = arr.model.path
    model_config, tokenizer = load_policy_files(path)
    for section, model in (("critic", cfg.critic.model), ("reward_model", cfg.reward_model.model)):
        enabled = cfg.critic.enable if section == "critic" else cfg.reward_model.enable
        if enabled and model.path:
            try:
                AutoConfig.from_pretrained(model.path)
            except (OSError, ValueError) as err:
                raise ConfigError(f"{section}.model.path={model.path!r} does not load: {err}") from err
    train_loader, val_loader = build_datasets(cfg, tokenizer)
    total_steps = total_steps_of(cfg, train_loader)
    train_ds, val_ds = train_loader.dataset, (val_loader.dataset if val_loader else None)
    _raise_preflight(preflight_errors(cfg, train_ds=train_ds, val_ds=val_ds))
    t = cfg.trainer
    folder = prepare_run_dir(t.default_local_dir, resume_mode=t.resume_mode, overwrite=t.overwrite,
                             total_steps=total_steps, save_freq=t.save_freq, check_only=True)  # RunDirError: exit 2
    reward_fn = build_reward_fn(cfg, tokenizer, load_reward_function(cfg))
    reward_fn.close()
    estimator = get_advantage_estimator(alg.adv_estimator)
    actor = arr.actor
    on_policy = is_on_policy(cfg)
    plan = {
        "model": {"path": path, "model_type": model_config.model_type, "vocab_size": model_config.vocab_size},
        "train_prompts": len(train_loader.dataset),
        "train_data_stats": dict(getattr(train_loader.dataset, "stats", {})),
        "val_prompts": len(val_loader.dataset) if val_loader else 0,
        "steps": total_steps,
        "optimizer_steps_per_step": cfg.data.train_batch_size // actor.ppo_mini_batch_size * actor.ppo_epochs,
        "ranks": cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node,
        "device": cfg.trainer.device,
        "rollout_engine": f"{arr.rollout.name} ({get_rollout_engine(arr.rollout.name).__name__})",
        "rollout_engine_kwargs": rollout_engine_kwargs(arr.rollout),
        "rollout_placement": "in the actor's processes (hybrid engine)" if arr.hybrid_engine else (
            f"a group of its own: {arr.rollout.nnodes} x {arr.rollout.n_gpus_per_node} processes, weights in "
            f"{arr.rollout.update_weights_bucket_megabytes} MB buckets"),
        "rollout_mode": cfg.trainer.rollout_mode,
        "passes": {
            "old_log_prob": not on_policy and not alg.rollout_correction.bypass_mode,
            "ref_log_prob": alg.use_kl_in_reward or actor.use_kl_loss,
            "critic": bool(cfg.critic.enable),
            "reward_model": cfg.reward_model.enable,
            "greedy_baseline": estimator.needs_greedy_baseline,
        },
        "custom_reward_function": cfg.custom_reward_function.path,
        "run_dir": {"path": t.default_local_dir, "start_step": folder.start_step,
                    **({"old_run_moves_to": folder.archived_to} if folder.archived_to else {}),
                    **({"nothing_to_train": True} if folder.start_step >= total_steps and not t.val_only else {})},
    }
    return {"config": to_dict(cfg), "plan": plan}
