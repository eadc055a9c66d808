"""LoRA for the training engine, with PEFT: wrap the transformers model, name weights for the rollout, merge per tensor.

`apply_lora` injects PEFT's LoRA layers into the transformers model in place (``get_peft_model``), before FSDP2
shards it, and freezes everything else: only ``lora_A`` / ``lora_B`` require grad, so only they get AdamW state. The
model object stays the same ``*ForCausalLM``, so `HeadOnPositions` and the per-layer ``fully_shard`` see the same tree,
with ``q_proj`` now a ``lora.Linear`` holding ``base_layer`` (the frozen weight) and the two adapter matrices.

The reference policy is the same model with the adapter layers switched off (`adapter_disabled`), so a LoRA run holds
one copy of the base weights. Weight sync and export use `merged_parameters`: HF (base) names, and for every
LoRA-wrapped weight ``W + scaling * B @ A`` computed as that one tensor is yielded (no merged copy of the model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["LoraSettings", "adapter_disabled", "apply_lora", "base_name", "merged_parameters"]

BASE_LAYER = ".base_layer"
ADAPTER = "default"  # PEFT's name for the one adapter we train


@dataclass
class LoraSettings:
    """veRL's actor_rollout_ref.model.lora_* keys; rank 0 = no LoRA."""

    rank: int = 0
    alpha: float = 16
    target_modules: str | list[str] = "all-linear"
    dropout: float = 0.0
    exclude_modules: str | list[str] | None = None
    extra: dict = field(default_factory=dict)  # further LoraConfig arguments (none from the config today)
    # veRL's lora_adapter_path: a saved PEFT adapter folder whose weights the adapter starts from (lora_adapter.py)
    adapter_path: str | None = None

    def validate(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora_rank is {self.rank}; it must be 0 (no LoRA) or a positive rank such as 8 or 32")
        if self.rank > 0 and self.alpha <= 0:
            raise ValueError(f"lora_alpha is {self.alpha}; it must be positive (commonly 2 * lora_rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora_dropout is {self.dropout}; it must be in [0, 1)")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ValueError(
                f"target_modules is {self.target_modules!r}; give 'all-linear' or a list of module names "
                "such as [q_proj,k_proj,v_proj,o_proj]"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def _linear_names(model: nn.Module) -> list[str]:
    """The distinct leaf names of the model's nn.Linear modules (what target_modules can name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear) and name})


def apply_lora(hf_model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Inject LoRA layers into `hf_model` in place and freeze the rest; returns the PeftModel wrapper (keep it for
    `adapter_disabled` and PEFT's save_pretrained). ValueError naming the model's Linear modules when the targets
    match none of them."""
    from peft import LoraConfig, get_peft_model

    settings.validate()
    targets = settings.target_modules
    if not isinstance(targets, str):
        targets = list(targets)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        exclude_modules=list(settings.exclude_modules) if isinstance(settings.exclude_modules, (list, tuple))
        else settings.exclude_modules,
        bias="none",
        task_type="CAUSAL_LM",
        **settings.extra,
    )
    try:
        peft_model = get_peft_model(hf_model, config)
    except ValueError as err:
        if "not found" not in str(err) and "did not match" not in str(err) and "matched no" not in str(err):
            raise
        raise ValueError(
            f"actor_rollout_ref.model.target_modules={settings.target_modules!r} "
            f"(exclude_modules={settings.exclude_modules!r}) matches no module of this "
            f"{type(hf_model).__name__}; its Linear modules are {_linear_names(hf_model)} (or use 'all-linear')"
        ) from None
    trainable = [n for n, p in hf_model.named_parameters() if p.requires_grad]
    if not trainable or any(".lora_" not in n for n in trainable):
        raise RuntimeError(f"LoRA left unexpected trainable parameters: {trainable[:5]}")
    if settings.adapter_path:
        from hybridflow.engines.lora_adapter import load_adapter_weights

        load_adapter_weights(peft_model, settings)
    return peft_model


@contextlib.contextmanager
def adapter_disabled(peft_model: nn.Module | None):
    """The base model inside the block (the LoRA reference policy); nothing changes when peft_model is None.

    PEFT also freezes a disabled adapter (requires_grad False until it is enabled again). The adapter stays trainable
    here: FSDP2 fixes at a model's first forward which parameters train, and casts only their reduced gradients back
    to the fp32 master shards (bf16 compute on several ranks). The reference pass is often the actor engine's first
    forward (a GRPO step with KL), and an adapter frozen then would get bf16 gradients it cannot take. The pass runs
    without grad, so the flag changes nothing else; PEFT's forward reads only whether the adapter is disabled."""
    if peft_model is None:
        yield
        return
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    with peft_model.disable_adapter():
        for p in trainable:
            p.requires_grad_(True)
        yield


def base_name(name: str) -> str | None:
    """A transformers name of the LoRA-injected model -> the name in the plain model; None for adapter tensors.

    ``model.layers.0.self_attn.q_proj.base_layer.weight`` -> ``model.layers.0.self_attn.q_proj.weight``;
    ``...q_proj.lora_A.default.weight`` -> None.
    """
    if ".lora_" in name:
        return None
    return name.replace(BASE_LAYER + ".", ".")


def merged_parameters(
    named: Iterator[tuple[str, nn.Parameter]], model: nn.Module, gather, prefix: str = ""
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(base name, full tensor)`` per weight of the plain model, in `named`'s order, adapter tensors folded in.

    named: ``model.named_parameters()`` (names relative to `model`); gather(param) -> its full tensor (a collective
    under FSDP2: every rank iterates the same way). `prefix` is stripped from the yielded names. For the weight of a
    LoRA Linear: ``W + scaling * B [out, r] @ A [r, in]``, one temporary of W's size.
    """
    modules = dict(model.named_modules())
    for name, param in named:
        plain = base_name(name)
        if plain is None:
            continue
        full = gather(param)
        if name.endswith(BASE_LAYER + ".weight"):
            lora_layer = modules[name[: -len(BASE_LAYER + ".weight")]]
            if ADAPTER in getattr(lora_layer, "lora_A", {}):
                a = gather(lora_layer.lora_A[ADAPTER].weight)
                b = gather(lora_layer.lora_B[ADAPTER].weight)
                full = full + lora_layer.scaling[ADAPTER] * (b @ a).to(full.dtype)
                del a, b
        yield plain[len(prefix) :] if plain.startswith(prefix) else plain, full
