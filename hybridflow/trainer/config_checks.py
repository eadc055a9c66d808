"""The checks behind `validate_config` (config.py): every setting that can be judged before a worker starts, one
message each naming the key, the value and what to set instead; and `check_resources` against the cluster.
"""

from __future__ import annotations

import os

from hybridflow.trainer.config import (
    FILTER_METRICS,
    ROUTER_REPLAY_MODES,
    ConfigError,
    HybridFlowConfig,
)

__all__ = ["check_resources", "config_errors"]


def config_errors(cfg: HybridFlowConfig) -> list[str]:
    """Every problem of `cfg` found without starting a worker (empty: the run may start)."""
    from hybridflow.algorithms.objective import check_loss_agg_mode
    from hybridflow.algorithms.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    from hybridflow.engines.rollout.registry import rollout_config_errors
    from hybridflow.trainer.parallel_checks import layout_errors
    from hybridflow.trainer.rollout_checks import placement_errors, rollout_correction_errors
    from hybridflow.workers.actor_rollout_ref import actor_loss_config
    from hybridflow.workers.agent_rollout import multi_turn_config_errors
    from hybridflow.workers.engine_config import STRATEGIES, lora_settings

    errors: list[str] = []
    d, arr, t, alg = cfg.data, cfg.actor_rollout_ref, cfg.trainer, cfg.algorithm
    actor, rollout = arr.actor, arr.rollout
    n = rollout.n
    world = t.nnodes * t.n_gpus_per_node
    # The registries answer for the names (and import a user's plugin named as 'package.module:attr').
    if problem := ADVANTAGE_ESTIMATORS.check(alg.adv_estimator):
        errors.append(f"algorithm.adv_estimator: {problem}")
    if problem := POLICY_LOSSES.check(actor.policy_loss.loss_mode):
        errors.append(f"actor_rollout_ref.actor.policy_loss.loss_mode: {problem}")
    errors += [f"actor_rollout_ref.actor.{p}" for p in actor_loss_config(actor).errors()]
    for key, mode in (("actor_rollout_ref.actor", actor.loss_agg_mode), ("critic", cfg.critic.loss_agg_mode)):
        if problem := check_loss_agg_mode(mode):
            errors.append(f"{key}.{problem}")
    errors += rollout_config_errors(rollout)
    errors += _router_replay_errors(actor.router_replay.mode, rollout.name)
    if arr.nccl_timeout <= 0:
        errors.append(f"actor_rollout_ref.nccl_timeout={arr.nccl_timeout} must be a positive number of seconds "
                      "(veRL's default: 600)")
    if actor.router_replay.mode == "R3" and (actor.ulysses_sequence_parallel_size > 1
                                             or actor.fsdp_config.tensor_model_parallel_size > 1):
        errors.append("actor_rollout_ref.actor.router_replay.mode=R3 does not combine with sequence / tensor-parallel "
                      "training (each rank routes part of a row); set ulysses_sequence_parallel_size and "
                      "fsdp_config.tensor_model_parallel_size to 1, or turn router replay off")
    if arr.model.lora_rank < 0:
        errors.append(
            f"actor_rollout_ref.model.lora_rank={arr.model.lora_rank}: give 0 (no LoRA) or a positive rank such as 8"
        )
    elif arr.model.lora_rank > 0:
        try:
            lora_settings(arr.model).validate()
        except ValueError as err:
            errors.append(f"actor_rollout_ref.model: {err}")
    if actor.strategy not in STRATEGIES:
        errors.append(
            f"actor_rollout_ref.actor.strategy={actor.strategy!r}: hybridflow trains with FSDP2 only "
            f"({' / '.join(STRATEGIES)}); Megatron is not supported, remove the key or set it to fsdp2"
        )
    errors += placement_errors(cfg)
    errors += rollout_correction_errors(alg.rollout_correction)
    errors += multi_turn_config_errors(cfg)
    if t.backend not in ("ray", "local"):
        errors.append(f"trainer.backend={t.backend!r}: choose 'ray' or 'local'")
    if t.backend == "local" and world != 1:
        errors.append(
            f"trainer.backend=local runs one process, but trainer.nnodes*trainer.n_gpus_per_node = {world}; "
            "set trainer.n_gpus_per_node=1 trainer.nnodes=1"
        )
    if t.placement not in ("colocate", "split"):
        errors.append(f"trainer.placement={t.placement!r}: choose 'colocate' or 'split'")
    if rollout.max_num_batched_tokens is not None and rollout.max_num_batched_tokens <= 0:
        errors.append(
            f"actor_rollout_ref.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens}: give a positive "
            "prefill token budget (e.g. 8192) or leave it unset"
        )
    errors += layout_errors(cfg)  # tensor-parallel sizes against the rank counts (parallel_checks.py)
    if rollout.gpu_memory_utilization is not None and not 0 < rollout.gpu_memory_utilization <= 1:
        errors.append(
            f"actor_rollout_ref.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1]"
        )
    if n < 1:
        errors.append(f"actor_rollout_ref.rollout.n={n} must be >= 1")
    for key in ("forward_micro_batch_size_per_gpu", "forward_max_token_len_per_gpu"):
        value = getattr(cfg.critic, key)
        if value is not None and value < 1:
            errors.append(f"critic.{key}={value} must be >= 1, or null for the critic's ppo_* size")
    if d.filter_overlong_prompts_workers < 1:
        errors.append(f"data.filter_overlong_prompts_workers={d.filter_overlong_prompts_workers} must be >= 1 "
                      "(processes that render and tokenize the prompts; 1: in the driver)")
    if d.truncation not in ("error", "left", "right"):
        errors.append(f"data.truncation={d.truncation!r}: choose error, left or right")
    if d.train_batch_size < 1 or actor.ppo_mini_batch_size < 1:
        errors.append("data.train_batch_size and actor_rollout_ref.actor.ppo_mini_batch_size must be >= 1")
    else:
        if d.train_batch_size % actor.ppo_mini_batch_size:
            errors.append(
                f"data.train_batch_size={d.train_batch_size} prompts must be a multiple of "
                f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} prompts "
                "(each step is split into whole mini-batches); change one of them"
            )
        if actor.ppo_mini_batch_size > d.train_batch_size:
            errors.append(
                f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} is larger than "
                f"data.train_batch_size={d.train_batch_size}"
            )
        mini_rows = actor.ppo_mini_batch_size * n
        if world > 0 and mini_rows % world:
            errors.append(
                f"a mini-batch holds ppo_mini_batch_size*n = {actor.ppo_mini_batch_size}*{n} = {mini_rows} "
                f"responses, which does not split evenly over {world} ranks (trainer.nnodes*trainer.n_gpus_per_node); "
                "change actor_rollout_ref.actor.ppo_mini_batch_size, actor_rollout_ref.rollout.n or the number of ranks"
            )
        elif not actor.use_dynamic_bsz and (mini_rows // max(world, 1)) % actor.ppo_micro_batch_size_per_gpu:
            per_rank = mini_rows // max(world, 1)
            errors.append(
                f"each rank gets {per_rank} responses per mini-batch, which is not a multiple of "
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={actor.ppo_micro_batch_size_per_gpu}; "
                "pick a micro-batch size that divides it, or set actor_rollout_ref.actor.use_dynamic_bsz=true"
            )
    if d.max_prompt_length < 1 or d.max_response_length < 1:
        errors.append("data.max_prompt_length and data.max_response_length must be >= 1")
    if rollout.temperature <= 0 and rollout.do_sample:
        errors.append("actor_rollout_ref.rollout.temperature must be > 0 when do_sample=true")
    if alg.filter_groups.enable and n < 2:
        errors.append("algorithm.filter_groups.enable=true needs actor_rollout_ref.rollout.n >= 2 (groups of samples)")
    if alg.filter_groups.metric not in FILTER_METRICS:
        errors.append(
            f"algorithm.filter_groups.metric={alg.filter_groups.metric!r}: choose one of {list(FILTER_METRICS)}"
        )
    if alg.filter_groups.enable and alg.use_kl_in_reward and alg.filter_groups.metric == "seq_final_reward":
        errors.append(
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the KL penalty is "
            "known only after the group filter has run; filter on seq_reward (the shaped score) instead"
        )
    if alg.filter_groups.enable and cfg.reward_model.launch_reward_fn_async:
        errors.append(
            "reward_model.launch_reward_fn_async=true with algorithm.filter_groups.enable=true: dynamic sampling needs "
            "each batch's scores before it decides what to train on, so they cannot wait in the background; set one "
            "of the two false"
        )
    if alg.filter_groups.max_num_gen_batches < 0:
        errors.append("algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = no limit)")
    from hybridflow.trainer.dynamic_sampling import dynamic_sampling_errors
    from hybridflow.trainer.verl_model_keys import switch_errors

    errors += dynamic_sampling_errors(cfg)
    errors += switch_errors(cfg)
    from hybridflow.trainer.profiling import profiler_errors

    errors += profiler_errors(cfg)
    from hybridflow.rewards.managers import check_reward_manager_config

    crf = cfg.custom_reward_function
    errors += check_reward_manager_config(cfg.reward_model.reward_manager, dict(cfg.reward_model.reward_kwargs),
                                          crf.path, dict(crf.reward_kwargs))
    from hybridflow.trainer.reward_loop import reward_model_errors

    errors += reward_model_errors(cfg)
    if cfg.reward_model.model.enable_gradient_checkpointing:
        errors.append(
            "reward_model.model.enable_gradient_checkpointing=true: the reward model is never trained here (it only "
            "scores), so there is no backward pass to checkpoint; remove the key"
        )
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        errors.append("trainer.resume_mode=resume_path needs trainer.resume_from_path=<a global_step_N folder>")
    if t.resume_from_path and t.resume_mode != "resume_path":
        errors.append(
            f"trainer.resume_from_path={t.resume_from_path!r} is read only with trainer.resume_mode=resume_path (as in "
            "veRL); set that, or give the path directly as trainer.resume_mode=<path>"
        )
    if t.log_val_generations < 0:
        errors.append(f"trainer.log_val_generations={t.log_val_generations} must be >= 0")
    if actor.recompute_old_log_prob not in ("auto", "always"):
        errors.append("actor_rollout_ref.actor.recompute_old_log_prob: choose auto or always")
    fusion = cfg.reward_model.sandbox_fusion
    if fusion.url is not None and not str(fusion.url).startswith(("http://", "https://")):
        errors.append(f"reward_model.sandbox_fusion.url={fusion.url!r}: give the service's run_code endpoint as an "
                      "http(s) url, e.g. http://host:8080/run_code")
    if fusion.max_concurrent < 1 or fusion.memory_limit_mb < 1:
        errors.append("reward_model.sandbox_fusion.max_concurrent and memory_limit_mb must be >= 1")
    if cfg.reward_model.sandbox and not cfg.custom_reward_function.path:
        errors.append(
            "reward_model.sandbox=true boxes a custom reward function, but custom_reward_function.path is not set; "
            "set it, or drop reward_model.sandbox (the built-in scorers are hybridflow's own code)"
        )
    errors += _pre_step_config_errors(cfg)
    from hybridflow.trainer.verl_features import feature_errors

    errors += feature_errors(cfg)  # veRL's pf_ppo, ref.strategy, rollout knobs, LoRA adapter, use_shm, dumps
    from hybridflow.trainer.parallel_checks import batch_invariant_errors, model_parallel_errors, packing_errors

    errors += model_parallel_errors(cfg)
    errors += packing_errors(cfg)
    errors += batch_invariant_errors(cfg)
    errors += _vllm_moe_errors(cfg)
    if t.fault_injection:
        from hybridflow.common.faults import parse_fault_specs

        try:
            parse_fault_specs(t.fault_injection)
        except ValueError as e:
            errors.append(str(e))
    return errors



def _router_replay_errors(mode: str, rollout_name: str) -> list[str]:
    key = "actor_rollout_ref.actor.router_replay.mode"
    if mode == "R2":
        return [f"{key}=R2 (replaying the old policy's own routes) is not implemented; use R3, which replays the "
                "rollout's routes, or disabled"]
    if mode not in ROUTER_REPLAY_MODES:
        return [f"{key}={mode!r}; choose one of {list(ROUTER_REPLAY_MODES)}"]
    if mode == "R3" and rollout_name != "native":
        return [f"{key}=R3 needs the rollout to record its routes, which the native engine does; set "
                f"actor_rollout_ref.rollout.name=native (it is {rollout_name!r})"]
    return []


def _vllm_moe_errors(cfg: HybridFlowConfig) -> list[str]:
    """The vLLM rollout cannot follow a mixture-of-experts policy on CPU (VLLMRollout.update_weights says why): found
    before the workers start instead of at the first weight sync."""
    arr = cfg.actor_rollout_ref
    path = arr.model.path
    if arr.rollout.name != "vllm" or not path or not os.path.isdir(path):
        return []
    from hybridflow.device import device_name

    if (cfg.trainer.device if cfg.trainer.device != "auto" else device_name()) != "cpu":
        return []
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return []  # the model checks name an unreadable model
    from hybridflow.engines.moe_train import is_mixture_of_experts

    if is_mixture_of_experts(config):
        return [f"actor_rollout_ref.rollout.name=vllm: the model at {path} is a mixture-of-experts model, and on CPU "
                "vLLM computes with wrong experts after an in-place weight update, so its rollout would not follow "
                "the policy; use actor_rollout_ref.rollout.name=native (or vLLM on a GPU)"]
    return []


def _pre_step_config_errors(cfg: HybridFlowConfig) -> list[str]:
    """Settings that would fail (or silently learn nothing) only after workers started: found here instead."""
    from hybridflow.algorithms.registry import ADVANTAGE_ESTIMATORS

    errors: list[str] = []
    t, alg = cfg.trainer, cfg.algorithm
    estimator = None if ADVANTAGE_ESTIMATORS.check(alg.adv_estimator) else ADVANTAGE_ESTIMATORS.get(alg.adv_estimator)
    if cfg.actor_rollout_ref.actor.optim.lr <= 0:
        errors.append(f"actor_rollout_ref.actor.optim.lr={cfg.actor_rollout_ref.actor.optim.lr:g} must be > 0 "
                      "(e.g. 1e-6); the actor would not learn")
    critic_on = cfg.critic.enable if cfg.critic.enable is not None else bool(getattr(estimator, "needs_critic", False))
    if critic_on and cfg.critic.optim.lr <= 0:
        errors.append(f"critic.optim.lr={cfg.critic.optim.lr:g} must be > 0 (e.g. 1e-5)")
    if t.total_training_steps is not None and t.total_training_steps <= 0:
        errors.append(f"trainer.total_training_steps={t.total_training_steps} must be >= 1, or unset (null) to train "
                      "trainer.total_epochs epochs")
    if t.total_epochs < 1 and t.total_training_steps is None:
        errors.append(f"trainer.total_epochs={t.total_epochs} must be >= 1 (or set trainer.total_training_steps)")
    if t.n_gpus_per_node < 1 or t.nnodes < 1:
        errors.append(f"trainer.nnodes={t.nnodes} and trainer.n_gpus_per_node={t.n_gpus_per_node} must be >= 1 "
                      "(on CPU, n_gpus_per_node is the number of rank processes per node)")
    return errors


def check_resources(cfg: HybridFlowConfig, available_cpus: float, available_gpus: float) -> None:
    """More ranks than devices is a configuration error, found before placement groups wait forever."""
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if not cfg.actor_rollout_ref.hybrid_engine:  # the rollout group's processes come on top of the actor's
        world += cfg.actor_rollout_ref.rollout.nnodes * cfg.actor_rollout_ref.rollout.n_gpus_per_node
    rm_devices = 0
    if cfg.reward_model.enable and cfg.reward_model.use_reward_loop:  # the reward loop's engines: devices of their own
        from hybridflow.trainer.reward_loop import reward_loop_replicas

        rm_devices = reward_loop_replicas(cfg) * cfg.reward_model.rollout.tensor_model_parallel_size
    if cfg.trainer.device == "cuda" and world + rm_devices > available_gpus:
        fix = "set trainer.device=cpu (or auto)" if available_gpus == 0 else "lower trainer.n_gpus_per_node"
        if rm_devices:
            fix += " (or use reward_model.use_reward_loop=false: the reward model in the actor's processes)"
        raise ConfigError(
            f"the run asks for {world + rm_devices} GPU ranks (trainer.nnodes*trainer.n_gpus_per_node, plus "
            "actor_rollout_ref.rollout.nnodes*n_gpus_per_node with hybrid_engine=false"
            + (f", plus {rm_devices} for the reward loop's engines" if rm_devices else "")
            + f") but the cluster has {available_gpus:g} GPUs; {fix}"
        )
    if world > max(available_cpus, 1) * 4:
        raise ConfigError(
            f"the run asks for {world} ranks but the cluster has {available_cpus:g} CPUs; "
            "lower trainer.n_gpus_per_node (on CPU, each rank is one process)"
        )
