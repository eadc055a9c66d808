"""veRL's config keys that hybridflow names differently, and the ones it refuses, each with the reason.

A veRL user's dotted overrides reach `merge_overrides` unchanged. A key hybridflow has is taken as it is; a key in
`ALIASES` is renamed to hybridflow's (``critic.model.fsdp_config.param_offload`` -> ``critic.fsdp_config.
param_offload``); a key under a prefix of `UNSUPPORTED` is refused with one line that says which feature it belongs
to and what to use instead. Nothing is accepted and dropped. `PLANNED` lists features that hybridflow does not have
*yet*, so their refusal names the work that will add them.
"""

from __future__ import annotations

# veRL key (or prefix ending in ".") -> hybridflow key (or prefix)
ALIASES: dict[str, str] = {
    # veRL's fsdp_config.mixed_precision.param_dtype is the compute dtype, hybridflow's fsdp_config.param_dtype
    **{f"{role}.mixed_precision.param_dtype": f"{ours}.param_dtype" for role, ours in (
        ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.actor.fsdp_config"),
        ("actor_rollout_ref.ref.fsdp_config", "actor_rollout_ref.ref.fsdp_config"),
        ("critic.model.fsdp_config", "critic.fsdp_config"), ("critic.fsdp_config", "critic.fsdp_config"))},
    # newer veRL keeps the Ulysses size in each engine's fsdp_config; its older (and hybridflow's) place is the role
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size":
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size":
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "critic.model.fsdp_config.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",
    "critic.fsdp_config.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",
    "critic.model.fsdp_config.": "critic.fsdp_config.",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "actor_rollout_ref.actor.optim.clip_grad": "actor_rollout_ref.actor.grad_clip",
    # newer veRL's top-level `reward:` section
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_kwargs.": "reward_model.reward_kwargs.",
    "reward.custom_reward_function.": "custom_reward_function.",
    "reward.num_workers": "reward_model.num_workers",
    # newer veRL groups the weight-transfer bucket under rollout.checkpoint_engine
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
}

_MEGATRON = "Megatron-LM training is not supported: hybridflow trains with FSDP2 (remove the megatron keys)"
_PROFILER = (
    "this profiler option is not taken: hybridflow profiles with tool=torch (global_profiler.tool/steps/save_path/"
    "profile_continuous_steps and each role's profiler.enable/ranks/all_ranks/tool/save_path, trainer/profiling.py); "
    "veRL's nsys / npu / torch_memory tool options are not supported"
)
_VISION = "vision-language models and image data are not supported (text models only)"
_SGLANG = "the SGLang / TensorRT-LLM rollouts are not supported; use rollout.name=vllm, native or hf"
_NPU = "Ascend NPUs are not supported (cpu and cuda devices)"

# prefix -> why the feature does not exist here
UNSUPPORTED: dict[str, str] = {
    "actor_rollout_ref.actor.megatron.": _MEGATRON,
    "actor_rollout_ref.ref.megatron.": _MEGATRON,
    "critic.megatron.": _MEGATRON,
    "actor_rollout_ref.actor.optim.override_optimizer_config.": _MEGATRON,
    "global_profiler.": _PROFILER,
    "actor_rollout_ref.actor.profiler.": _PROFILER,
    "actor_rollout_ref.ref.profiler.": _PROFILER,
    "actor_rollout_ref.rollout.profiler.": _PROFILER,
    "critic.profiler.": _PROFILER,
    "data.image_key": _VISION,
    "data.video_key": _VISION,
    "actor_rollout_ref.actor.freeze_vision_tower": _VISION,
    "actor_rollout_ref.rollout.engine_kwargs.sglang.": _SGLANG,
    "actor_rollout_ref.rollout.engine_kwargs.trtllm.": _SGLANG,
    "actor_rollout_ref.actor.profiler.tool_config.npu.": _NPU,
    "actor_rollout_ref.rollout.prometheus.": "vLLM's Prometheus server is not started by hybridflow; metrics go to "
    "trainer.logger (console, jsonl, tensorboard, wandb, mlflow)",
    "actor_rollout_ref.rollout.disable_log_stats": "hybridflow runs vLLM in-process and logs its own rollout metrics",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": "veRL's Interaction classes are not loaded; "
    "give an environment (reset/step) as actor_rollout_ref.rollout.multi_turn.environment=package.module:Class",
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": "episodes are kept token-in/token-out: the "
    "history is never re-rendered, so there is no training-time template to choose (remove the key)",
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": "episodes are never re-tokenized, so "
    "there is nothing to check (remove the key)",
    "actor_rollout_ref.rollout.multi_turn.completion_callback": "veRL's completion callbacks are not supported; "
    "use an environment's step() (multi_turn.environment)",
    "model.use_liger": "Liger kernels are not used; hybridflow's chunked log-prob/entropy keeps [tokens, vocab] "
    "small without them",
    "data.sampler.": "veRL's sampler classes (curriculum sampling) are not loaded; data.shuffle and data.seed order "
    "the prompts (a dataset class, data.custom_cls, can order its own items)",
    "actor_rollout_ref.model.enable_activation_offload": "activations are not offloaded to host memory; "
    "actor_rollout_ref.model.enable_gradient_checkpointing keeps one layer's activations at a time",
}

# prefix -> the open issue whose work adds the feature (refused until it lands)
PLANNED: dict[str, str] = {
    "actor_rollout_ref.rollout.multi_stage_wake_up": "staged vLLM wake-up (issue #19)",
    "actor_rollout_ref.rollout.checkpoint_engine.": "this option of veRL's checkpoint engine (its bucket size is taken: "
    "checkpoint_engine.update_weights_bucket_megabytes)",
    "actor_rollout_ref.rollout.expert_parallel_size": "expert-parallel rollout (issue #17/#20)",
    "actor_rollout_ref.rollout.data_parallel_size": "rollout data parallelism apart from training (issue #19)",
    "critic.model.lora_": "LoRA on the critic (issue #17); LoRA is on the actor (actor_rollout_ref.model.lora_rank)",
    "critic.model.target_modules": "LoRA on the critic (issue #17)",
    "model.lora_": "LoRA in SFT (issue #17)",
    "model.target_modules": "LoRA in SFT (issue #17)",
    "actor_rollout_ref.actor.fsdp_config.": "this FSDP option (issue #21)",
    "actor_rollout_ref.ref.fsdp_config.": "this FSDP option (issue #21)",
    "actor_rollout_ref.actor.optim.lr_decay_style": "veRL Megatron's scheduler key; use optim.lr_scheduler_type",
    "algorithm.rollout_correction.": "this rollout-correction option (hybridflow takes rollout_is, _threshold, "
    "_batch_normalize, rollout_rs, _threshold, _threshold_lower, rollout_token_veto_threshold and bypass_mode)",
    # taken: rollout.name / gpu_memory_utilization / tensor_model_parallel_size / prompt_length / response_length
    "reward_model.rollout.": "this option of the reward model's engine (issue #21); the reward loop takes name, "
    "gpu_memory_utilization, tensor_model_parallel_size, prompt_length and response_length",
    "reward_model.enable_resource_pool": "a reward-model pool sized apart from the trainer's (issue #21); the reward "
    "loop runs trainer.nnodes*n_gpus_per_node // reward_model.rollout.tensor_model_parallel_size engine processes",
    "reward_model.n_gpus_per_node": "a reward-model pool sized apart from the trainer's (issue #21)",
    "reward_model.nnodes": "a reward-model pool sized apart from the trainer's (issue #21)",
    # taken: param_offload
    "reward_model.model.fsdp_config.": "this FSDP option for the reward model (issue #21): it runs unsharded, one "
    "copy per process; fsdp_config.param_offload is taken",
}


# veRL's DAPO recipe (recipe/dapo/*.sh) and the vLLM engine knobs its scripts set
ALIASES.update({
    # the recipe's first scripts named the overlong buffer under custom_reward_function
    "custom_reward_function.overlong_buffer.": "reward_model.overlong_buffer.",
    "model.partial_pretrain": "model.path",  # veRL's SFT trainer names the model to fine-tune so
})
UNSUPPORTED.update({
    # veRL's global micro-batch keys are divided by the ranks (verl_micro_batch.py); this one is the SFT trainer's
    "data.micro_batch_size": "veRL's SFT key, taken by `hybridflow sft`; an RL run's micro-batches are "
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (or veRL's global actor.ppo_micro_batch_size)",
    # known to `hybridflow sft` (its schema takes them first); in an RL run they name no feature
    "data.multiturn.": "data.multiturn.* is veRL's multi-turn SFT data, read by `hybridflow sft`; RL multi-turn "
    "rollouts are actor_rollout_ref.rollout.multi_turn (issue #18)",
    "actor_rollout_ref.actor.use_token_level_loss": "veRL's older switch; use actor_rollout_ref.actor.loss_agg_mode="
    "token-mean (true) or seq-mean-token-mean (false)",
})
# veRL's fully-async recipe (recipe/fully_async_policy, its own entry point): different staleness semantics
_ASYNC_RECIPE = (
    "veRL's fully-async recipe keys are not read: hybridflow's asynchronous training is trainer.rollout_mode=async "
    "(or one_step_off) with actor_rollout_ref.hybrid_engine=false, trainer.max_staleness (in policy versions, not a "
    "fraction of samples), trainer.rollout_buffer_batches, and algorithm.rollout_correction.bypass_mode=true for "
    "the rollout's log-probs as the old policy; weights are synced after every update and partial rollouts are not "
    "implemented"
)
UNSUPPORTED["async_training."] = _ASYNC_RECIPE


def alias_of(key: str) -> str | None:
    """hybridflow's name for a veRL key, or None."""
    for verl, ours in ALIASES.items():
        if key == verl or (verl.endswith(".") and key.startswith(verl)):
            return ours + key[len(verl):] if verl.endswith(".") else ours
    return None


def refusal(key: str) -> str | None:
    """Why a veRL key is refused here (one line), or None when it is not one of the known refused ones."""
    for table, lead in ((UNSUPPORTED, ""), (PLANNED, "not in hybridflow yet: ")):
        for prefix, reason in table.items():
            if key == prefix or (prefix.endswith((".", "_")) and key.startswith(prefix)):
                return f"{key}: {lead}{reason}"
    return None
