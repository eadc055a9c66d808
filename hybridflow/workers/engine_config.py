"""Translate the trainer's typed config sections into engine configs (one place, shared by every worker)."""

from __future__ import annotations

from typing import Any

from hybridflow.engines.engine_config import EngineConfig, OptimConfig
from hybridflow.engines.lora import LoraSettings

STRATEGIES = ("fsdp", "fsdp2")  # veRL's names; both mean FSDP2 (torch's fully_shard) here


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


def lora_settings(model: Any) -> LoraSettings:
    """actor_rollout_ref.model's lora_* keys -> the engine's LoraSettings (rank 0: off)."""
    if int(model.lora_rank) == 0:
        return LoraSettings()  # the other lora keys mean nothing without a rank (veRL's defaults are set anyway)
    targets = model.target_modules
    excludes = model.exclude_modules
    return LoraSettings(
        rank=int(model.lora_rank),
        alpha=model.lora_alpha,
        target_modules=targets if isinstance(targets, str) else list(targets),
        dropout=float(model.lora_dropout),
        exclude_modules=excludes if excludes is None or isinstance(excludes, str) else list(excludes),
        adapter_path=getattr(model, "lora_adapter_path", None),
    )


# veRL's spellings of a model load dtype (fsdp_config.model_dtype, model.torch_dtype) -> the engine's name
MODEL_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "torch.float32": "fp32",
                     "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16"}


def model_dtype(fsdp: Any, model: Any) -> str:
    """The dtype an engine loads its weights in: the role's fsdp_config.model_dtype, else the policy model's
    torch_dtype (actor and ref), else fp32. ValueError naming the key for a dtype the engine does not train in."""
    for key, value in (("fsdp_config.model_dtype", getattr(fsdp, "model_dtype", None)),
                       ("model.torch_dtype", getattr(model, "torch_dtype", None))):
        if value is None:
            continue
        if str(value) not in MODEL_DTYPE_NAMES:
            fp16 = " (fp16 weights need loss scaling, which the engine does not do)" if "16" in str(value) else ""
            raise ValueError(f"{key}={value!r}: choose fp32/float32 or bf16/bfloat16{fp16}")
        return MODEL_DTYPE_NAMES[str(value)]
    return "fp32"


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
    infer_micro_batch_size: int | None = None,
    infer_use_dynamic_bsz: bool | None = None,
    infer_max_token_len: int | None = None,
    router_aux_loss_coef: float | None = None,
    router_replay: bool = False,
    ulysses_sequence_parallel_size: int = 1,
    entropy_checkpointing: bool = False,
    share_prompts: bool | None = None,
) -> EngineConfig:
    """One engine's config. The ``infer_*`` settings size the forward-only passes (log-probs, values), which hold
    no activations for backward and may use larger micro-batches than training; None: the training settings."""
    kwargs = dict(
        model_path=model_path,
        role=role,
        param_dtype=fsdp.param_dtype,
        model_dtype=model_dtype(fsdp, model),
        reduce_dtype=MODEL_DTYPE_NAMES[str(fsdp.mixed_precision.reduce_dtype)],
        buffer_dtype=MODEL_DTYPE_NAMES[str(fsdp.mixed_precision.buffer_dtype)],
        micro_batch_size_per_gpu=micro_batch_size,
        use_dynamic_bsz=use_dynamic_bsz,
        max_tokens_per_micro_batch=max_token_len,
        gradient_checkpointing=model.enable_gradient_checkpointing,
        param_offload=fsdp.param_offload,
        optimizer_offload=fsdp.optimizer_offload,
        fsdp_size=fsdp.fsdp_size,
        forward_prefetch=fsdp.forward_prefetch,
        tensor_parallel_size=fsdp.tensor_model_parallel_size,
        ulysses_sequence_parallel_size=ulysses_sequence_parallel_size,
        seed=seed,
        use_remove_padding=model.use_remove_padding,
        infer_micro_batch_size_per_gpu=infer_micro_batch_size,
        infer_use_dynamic_bsz=infer_use_dynamic_bsz,
        infer_max_tokens_per_micro_batch=infer_max_token_len,
        router_aux_loss_coef=router_aux_loss_coef,
        router_replay=router_replay,
        entropy_checkpointing=entropy_checkpointing,
        share_prompts=share_prompts,
    )
    if optim is not None:
        kwargs["optim"] = optim
    if hasattr(model, "use_sequence_packing"):  # actor_rollout_ref.model (actor and ref); the critic: the default
        kwargs["use_sequence_packing"] = model.use_sequence_packing
    if role in ("actor", "ref") and getattr(model, "batch_invariant", False):
        kwargs["batch_invariant"] = True
    if role == "actor" and getattr(model, "use_fused_kernels", False):  # veRL's key: hf_model.py recomputes logits
        kwargs["logits_checkpointing"] = True
    if role == "actor" and hasattr(model, "lora_rank"):
        kwargs["lora"] = lora_settings(model)
    return EngineConfig(**kwargs)
