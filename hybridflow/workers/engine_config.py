"""Translate the trainer's typed config sections into engine configs (one place, shared by every worker)."""

from __future__ import annotations

from typing import Any

from hybridflow.engines.fsdp_engine import EngineConfig, OptimConfig


def optim_config(optim: Any, grad_clip: float, total_steps: int) -> OptimConfig:
    scheduler = optim.warmup_style or optim.lr_scheduler_type
    if scheduler not in ("constant", "cosine"):
        raise ValueError(f"lr scheduler {scheduler!r} is unknown; choose constant or cosine")
    return OptimConfig(
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=tuple(optim.betas),
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_warmup_steps_ratio=optim.lr_warmup_steps_ratio,
        lr_scheduler_type=scheduler,
        min_lr_ratio=optim.min_lr_ratio,
        total_training_steps=total_steps,
        grad_clip=grad_clip,
    )


def engine_config(
    *,
    model_path: str,
    role: str,
    model: Any,
    fsdp: Any,
    seed: int,
    micro_batch_size: int,
    use_dynamic_bsz: bool,
    max_token_len: int,
    optim: OptimConfig | None = None,
) -> EngineConfig:
    kwargs = dict(
        model_path=model_path,
        role=role,
        param_dtype=fsdp.param_dtype,
        micro_batch_size_per_gpu=micro_batch_size,
        use_dynamic_bsz=use_dynamic_bsz,
        max_tokens_per_micro_batch=max_token_len,
        gradient_checkpointing=model.enable_gradient_checkpointing,
        param_offload=fsdp.param_offload,
        optimizer_offload=fsdp.optimizer_offload,
        fsdp_size=fsdp.fsdp_size,
        seed=seed,
        use_remove_padding=model.use_remove_padding,
    )
    if optim is not None:
        kwargs["optim"] = optim
    return EngineConfig(**kwargs)


def rollout_engine_kwargs(rollout: Any) -> dict[str, Any]:
    """The rollout section's veRL engine switches as the chosen engine's kwargs, under explicit ``engine_kwargs``.

    native: enforce_eager -> decode ("eager", or "auto": CUDA graphs on GPUs), free_cache_engine -> free_cache_engine;
    vllm: enforce_eager, gpu_memory_utilization as they are; hf has no such switches.
    """
    kwargs: dict[str, Any] = {}
    if rollout.name == "native":
        if rollout.enforce_eager is not None:
            kwargs["decode"] = "eager" if rollout.enforce_eager else "auto"
        if rollout.free_cache_engine is not None:
            kwargs["free_cache_engine"] = bool(rollout.free_cache_engine)
    elif rollout.name == "vllm":
        if rollout.enforce_eager is not None:
            kwargs["enforce_eager"] = bool(rollout.enforce_eager)
        if rollout.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = float(rollout.gpu_memory_utilization)
    kwargs.update(dict(rollout.engine_kwargs))
    return kwargs
