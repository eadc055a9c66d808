"""LoRA for the training engine, with PEFT: wrap the transformers model, name weights for the rollout, merge per tensor.

`apply_lora` injects PEFT's LoRA layers into the transformers model in place (``get_peft_model``), before FSDP2
shards it, and freezes everything else: only ``lora_A`` / ``lora_B`` require grad, so only they get AdamW state. The
model object stays the same ``*ForCausalLM``, so `HeadOnPositions` and the per-layer ``fully_shard`` see the same tree,
with ``q_proj`` now a ``lora.Linear`` holding ``base_layer`` (the frozen weight) and the two adapter matrices.

The reference policy is the same model with the adapter layers switched off (`adapter_disabled`), so a LoRA run holds
one copy of the base weights. Weight sync and export use `merged_parameters`: HF (base) names, and for every
LoRA-wrapped weight ``W + scaling * B @ A`` computed as that one tensor is yielded (no merged copy of the model).

Mixture-of-experts models (Qwen3-MoE in transformers 5) keep their experts as 3-D parameters (``experts.gate_up_proj
[E, ...]``) and the router as a weight of its own module; PEFT's ``all-linear`` adapts those too, each through a
``ParamWrapper`` around the module that holds the parameter (nested: ``experts.base_layer.base_layer.gate_up_proj``
under two wrappers, one per parameter). Their merged weight is the parameter plus PEFT's own ``get_delta_weight`` of
each wrapper of that parameter, computed on the gathered adapter tensors.
"""

from __future__ import annotations

import contextlib
import copy
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
    while BASE_LAYER + "." in name:  # nested wrappers (MoE experts: one per parameter) leave base_layer.base_layer
        name = name.replace(BASE_LAYER + ".", ".")
    return name


def merged_parameters(
    named: Iterator[tuple[str, nn.Parameter]], model: nn.Module, gather, prefix: str = "",
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(base name, full tensor)`` per weight of the plain model, in `named`'s order, adapter tensors folded in.

    named: ``model.named_parameters()`` (names relative to `model`); gather(param) -> its full tensor (a collective
    under FSDP2: every rank iterates the same way). `prefix` is stripped from the yielded names. For the weight of a
    LoRA Linear: ``W + scaling * B [out, r] @ A [r, in]``, one temporary of W's size; for a parameter under PEFT
    ParamWrappers (MoE experts and router): plus each wrapper's delta of that parameter. `dtype`: every tensor in it
    (the engine's weights dtype, where frozen base weights are stored in the compute dtype), the sum taken in it.
    """
    modules = dict(model.named_modules())
    for name, param in named:
        plain = base_name(name)
        if plain is None:
            continue
        full = gather(param)
        if dtype is not None:
            full = full.to(dtype)
        for layer in _lora_layers_of(name, modules):
            full = full + _delta_weight(layer, gather).to(full.dtype)
        yield plain[len(prefix) :] if plain.startswith(prefix) else plain, full


def _lora_layers_of(name: str, modules: dict[str, nn.Module]) -> list[nn.Module]:
    """The LoRA layers whose adapter adds to parameter `name`: the wrappers above its module (``a.base_layer.weight``
    -> ``a``; ``e.base_layer.base_layer.p`` -> ``e.base_layer`` and ``e``), a ParamWrapper only for its own
    parameter."""
    owner, _, leaf = name.rpartition(".")
    layers = []
    while owner.endswith(BASE_LAYER):
        owner = owner[: -len(BASE_LAYER)]
        layer = modules[owner]
        if ADAPTER not in getattr(layer, "lora_A", {}):
            continue
        if getattr(layer, "parameter_name", "weight") == leaf:
            layers.append(layer)
    return layers


def _delta_weight(layer: nn.Module, gather) -> torch.Tensor:
    """The layer's ``scaling * B @ A`` in its base parameter's shape, from the gathered adapter tensors. A lora.Linear:
    that product. A ParamWrapper: PEFT's own get_delta_weight (its expert layout), called on a shallow copy of the
    layer that holds the gathered tensors instead of its (possibly sharded) ones."""
    a = gather(layer.lora_A[ADAPTER].weight)
    b = gather(layer.lora_B[ADAPTER].weight)
    if not hasattr(layer, "parameter_name"):
        return layer.scaling[ADAPTER] * (b @ a)
    full = copy.copy(layer)
    full._modules = dict(layer._modules)  # the copy's own children: lora_A / lora_B replaced below, not the layer's
    for key, weight in (("lora_A", a), ("lora_B", b)):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        full._modules[key] = nn.ModuleDict({ADAPTER: linear})
    return full.get_delta_weight(ADAPTER)
