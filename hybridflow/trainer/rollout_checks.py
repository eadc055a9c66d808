"""Start-up checks of the rollout's placement and mode (``hybrid_engine``, ``rollout.nnodes/n_gpus_per_node``,
``trainer.rollout_mode``, staleness) and of the off-policy corrections (``algorithm.rollout_correction``).

Called by config_checks.config_errors; each message names the key and what to change.
"""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.off_policy import LEVELS as CORRECTION_LEVELS


def placement_errors(cfg: Any) -> list[str]:
    """The rollout's placement and mode: a separate rollout group, one_step_off / async, staleness."""
    from hybridflow.algorithms.registry import ADVANTAGE_ESTIMATORS
    from hybridflow.engines.rollout.registry import rollout_weight_update_error
    from hybridflow.trainer.rollout_driver import ROLLOUT_MODES

    errors: list[str] = []
    arr, t, alg = cfg.actor_rollout_ref, cfg.trainer, cfg.algorithm
    r = arr.rollout
    if problem := rollout_weight_update_error(r.name):
        errors.append(problem)
    if t.rollout_mode not in ROLLOUT_MODES:
        errors.append(f"trainer.rollout_mode={t.rollout_mode!r}: choose one of {list(ROLLOUT_MODES)}")
    if arr.hybrid_engine:
        for key, default in (("nnodes", 1), ("n_gpus_per_node", 1), ("update_weights_bucket_megabytes", 64)):
            if getattr(r, key) != default:
                errors.append(
                    f"actor_rollout_ref.rollout.{key}={getattr(r, key)} applies to a rollout group of its own; set "
                    "actor_rollout_ref.hybrid_engine=false too, or remove the key (the hybrid engine's rollout lives "
                    "in the actor's processes and gets its weights in memory)"
                )
        if t.rollout_mode != "sync":
            errors.append(
                f"trainer.rollout_mode={t.rollout_mode} overlaps generation with training, which needs the rollout "
                "in processes of its own: set actor_rollout_ref.hybrid_engine=false (and "
                "actor_rollout_ref.rollout.n_gpus_per_node), or trainer.rollout_mode=sync"
            )
    else:
        if t.backend == "local":
            errors.append(
                "actor_rollout_ref.hybrid_engine=false with trainer.backend=local: the weight transfer needs the actor "
                "and the rollout in different processes; use trainer.backend=ray"
            )
        if r.nnodes < 1 or r.n_gpus_per_node < 1:
            errors.append(
                f"actor_rollout_ref.rollout.nnodes={r.nnodes} and n_gpus_per_node={r.n_gpus_per_node} must be >= 1"
            )
        if r.update_weights_bucket_megabytes < 1:
            errors.append(
                f"actor_rollout_ref.rollout.update_weights_bucket_megabytes={r.update_weights_bucket_megabytes} "
                "must be >= 1"
            )
    if t.rollout_mode != "async":
        for key, default in (("max_staleness", 1), ("rollout_buffer_batches", 2)):
            if getattr(t, key) != default:
                errors.append(f"trainer.{key} applies to trainer.rollout_mode=async only; remove it or set the mode")
    if t.max_staleness < 0:
        errors.append(f"trainer.max_staleness={t.max_staleness} must be >= 0 (policy versions a sample may lag)")
    if t.rollout_buffer_batches < 1:
        errors.append(f"trainer.rollout_buffer_batches={t.rollout_buffer_batches} must be >= 1")
    estimator = ADVANTAGE_ESTIMATORS.get(alg.adv_estimator) if not ADVANTAGE_ESTIMATORS.check(alg.adv_estimator) else None
    if estimator is not None and getattr(estimator, "needs_critic", False) and cfg.critic.enable is False:
        errors.append(
            f"algorithm.adv_estimator={alg.adv_estimator} needs a critic's values, but critic.enable=false (in every "
            f"rollout mode, {t.rollout_mode} included, the values come from the critic at training time); enable "
            "the critic or pick a critic-free estimator (grpo, rloo, reinforce_plus_plus)"
        )
    if t.rollout_mode != "sync":
        if alg.filter_groups.enable:
            errors.append(
                f"algorithm.filter_groups.enable=true with trainer.rollout_mode={t.rollout_mode}: DAPO's dynamic "
                "sampling generates again inside a step, which the overlapped modes do not do; use rollout_mode=sync"
            )
        if estimator is not None and getattr(estimator, "needs_greedy_baseline", False):
            errors.append(
                f"algorithm.adv_estimator={alg.adv_estimator} needs a greedy generation inside each step, which "
                f"trainer.rollout_mode={t.rollout_mode} does not make; use rollout_mode=sync"
            )
    return errors


def rollout_correction_errors(rc: Any) -> list[str]:
    key = "algorithm.rollout_correction"
    errors = []
    for name in ("rollout_is", "rollout_rs"):
        value = getattr(rc, name)
        if value is not None and value not in CORRECTION_LEVELS:
            errors.append(f"{key}.{name}={value!r}: choose one of {list(CORRECTION_LEVELS)} (or null: off)")
    if rc.rollout_is_threshold <= 1.0:
        errors.append(f"{key}.rollout_is_threshold={rc.rollout_is_threshold} must be > 1 (the cap on pi_old/pi_rollout)")
    upper = rc.rollout_rs_threshold if rc.rollout_rs_threshold is not None else rc.rollout_is_threshold
    lower = rc.rollout_rs_threshold_lower if rc.rollout_rs_threshold_lower is not None else 1.0 / upper
    if not 0 <= lower < 1 < upper:
        errors.append(f"{key}: the rejection band [{lower}, {upper}] (rollout_rs_threshold_lower, rollout_rs_threshold) "
                      "must hold 1 strictly inside")
    if rc.rollout_is is None and rc.rollout_rs is None:
        for name in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
            if getattr(rc, name) is not None:
                errors.append(f"{key}.{name} is set but neither rollout_is nor rollout_rs is on; set one of them")
        if rc.rollout_is_threshold != 2.0:
            errors.append(f"{key}.rollout_is_threshold is set but rollout_is and rollout_rs are off; set one of them")
    elif rc.rollout_rs is None and (rc.rollout_rs_threshold is not None or rc.rollout_rs_threshold_lower is not None):
        errors.append(f"{key}.rollout_rs_threshold(_lower) is set but rollout_rs is off; set rollout_rs=token|sequence")
    veto = rc.rollout_token_veto_threshold
    if veto is not None and not 0 < veto < 1:
        errors.append(f"{key}.rollout_token_veto_threshold={veto} must be in (0, 1): a sequence is rejected when one "
                      "token's pi_old/pi_rollout falls below it (veRL suggests 1e-4 .. 1e-6), or null: no veto")
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        errors.append(f"{key}.rollout_is_batch_normalize=true normalises the IS weights, but rollout_is is off; set "
                      "rollout_is=token|sequence, or drop the key")
    if rc.bypass_mode and veto is not None:
        errors.append(f"{key}.bypass_mode=true makes every ratio pi_old/pi_rollout 1, so the veto could never fire; "
                      "set bypass_mode=false or rollout_token_veto_threshold=null")
    if rc.bypass_mode and (rc.rollout_is is not None or rc.rollout_rs is not None):
        errors.append(f"{key}.bypass_mode=true uses the rollout's log-probs as old log-probs, so every ratio "
                      "pi_old/pi_rollout would be 1: set rollout_is=null and rollout_rs=null, or bypass_mode=false "
                      "(decoupled PPO: old log-probs recomputed, the weight corrects for the rollout)")
    return errors
