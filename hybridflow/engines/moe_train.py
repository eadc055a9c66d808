"""Mixture-of-experts in the training engine: the router's load-balancing loss and router statistics.

A transformers MoE model (Qwen3-MoE, Qwen2-MoE, Mixtral, ...) routes each token through a router module that returns
``(router_logits [T, E], top-k weights [T, k], expert ids [T, k])``. `RouterTap` puts a forward hook on every such
module and keeps what the routers of one micro-batch forward returned, so the engine can

* add the auxiliary load-balancing loss the model family defines (its own ``load_balancing_loss_func``, called on
  the real tokens only), weighted by ``router_aux_loss_coef``: the same term transformers' CausalLM forward adds when
  ``config.output_router_logits`` is true (the engine runs the backbone itself, so it adds the term itself);
* log router statistics: how evenly each layer spreads its token->expert assignments (``max_load_ratio`` = the
  busiest expert's share times E; 1.0 is a perfect balance, E means one expert takes every token), per MoE layer,
  their mean and the worst layer's;
* replay the rollout's routing (R3, ``actor.router_replay.mode=R3``): the native rollout records the experts each
  token went to (``routed_experts``), and the training forwards use that choice instead of their own top-k. Only
  the discrete choice is replayed: the weights of the chosen experts are the live router's softmax at those experts
  (renormalised as the config says), so the router still gets gradients. Engines that compute the same logits up
  to rounding can still pick different experts on a near tie, and one flip moves a token's log-prob far more than
  rounding does; replay removes that part of the rollout/training mismatch.

These models route without a capacity limit, so no token is dropped or overflows; there is nothing of that kind to
count. The hooks hold tensors only while `capture()` is open (one forward); the recompute of activation checkpointing
during backward runs outside it and is not recorded.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["RouterTap", "aux_loss_coef", "find_routers", "is_mixture_of_experts"]


def is_mixture_of_experts(hf_config) -> bool:
    """Whether a transformers config routes tokens to experts (Qwen-MoE's num_experts, Mixtral's num_local_experts,
    DeepSeek's n_routed_experts), read from its text config."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return any(getattr(text, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts"))


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The router modules of `model`, in layer order: modules with ``top_k``, ``num_experts`` and a 2-D ``weight``
    of ``[num_experts, hidden]`` (transformers 5's ``*TopKRouter`` classes)."""
    routers = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        experts = getattr(module, "num_experts", None)
        if (isinstance(getattr(module, "top_k", None), int) and isinstance(experts, int)
                and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == experts):
            routers.append(module)
    return routers


def aux_loss_coef(hf_config, override: float | None) -> float:
    """The weight of the load-balancing loss: `override` when set, else transformers' rule for this config
    (``router_aux_loss_coef`` when ``output_router_logits`` is true, otherwise no auxiliary loss)."""
    if override is not None:
        return float(override)
    if getattr(hf_config, "output_router_logits", False):
        return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    return 0.0


def _loss_function(hf_model: nn.Module) -> Callable:
    module = importlib.import_module(type(hf_model).__module__)
    fn = getattr(module, "load_balancing_loss_func", None)
    if fn is None:
        raise ValueError(
            f"router_aux_loss_coef is set but {type(hf_model).__name__}'s module ({module.__name__}) defines no "
            "load_balancing_loss_func; set actor_rollout_ref.actor.router_aux_loss_coef=0 for this model"
        )
    return fn


class RouterTap:
    """Forward hooks on the routers of `hf_model` (see the module docstring). ``len(tap) == 0``: not an MoE model."""

    def __init__(self, hf_model: nn.Module, coef: float) -> None:
        self.routers = find_routers(hf_model)
        self.coef = coef if self.routers else 0.0
        self.num_experts = self.routers[0].num_experts if self.routers else 0
        self.top_k = self.routers[0].top_k if self.routers else 0
        self._loss_fn = _loss_function(hf_model) if self.coef else None
        self._recording = False
        self._logits: list[torch.Tensor] = []
        self._experts: list[torch.Tensor] = []
        self._replay: list[torch.Tensor] | None = None
        for index, router in enumerate(self.routers):
            router.register_forward_hook(functools.partial(self._hook, index))

    def __len__(self) -> int:
        return len(self.routers)

    def _hook(self, index: int, module: nn.Module, args, output):
        if self._replay is not None:
            output = self._replayed(module, output, self._replay[index])
        if self._recording:
            self._logits.append(output[0])
            self._experts.append(output[-1])
        return output

    @staticmethod
    def _replayed(module: nn.Module, output, chosen: torch.Tensor):
        logits, _, own = output[0], output[1], output[-1]
        if chosen.shape != own.shape:
            raise ValueError(f"routing replay: the batch's routed_experts give {tuple(chosen.shape)} [tokens, k] for "
                             f"a router that sees {tuple(own.shape)}; the routes must come from the same rows")
        chosen = torch.where(chosen >= 0, chosen.to(own.dtype), own)  # -1: never routed at rollout, keep own
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, chosen)
        if getattr(module, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (logits, weights.to(logits.dtype), chosen)

    def set_replay(self, routes: torch.Tensor | None) -> None:
        """``routes [T, layers, k]`` (the tokens of the next forwards, in the order their routers see them; -1 =
        route freely), or None to stop replaying. Stays set through backward, which recomputes checkpointed layers."""
        if routes is None or not self.routers:
            self._replay = None
            return
        if routes.shape[1] != len(self.routers):
            raise ValueError(f"routing replay: routed_experts has {routes.shape[1]} MoE layers, the model "
                             f"{len(self.routers)}; the rollout must run the same checkpoint")
        self._replay = [routes[:, i].long() for i in range(routes.shape[1])]

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the routers' outputs of the forward run inside this block (the previous record is dropped)."""
        self._logits, self._experts = [], []
        self._recording = bool(self.routers)
        try:
            yield
        finally:
            self._recording = False

    def aux_loss(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The recorded forward's load-balancing loss (a scalar on the autograd graph), or None when off.

        `attention_mask` ``[b, L]`` of the forward's ``input_ids`` (None: every position is a real token).
        """
        if not self.coef or not self._logits:
            return None
        return self._loss_fn(tuple(self._logits), self.num_experts, self.top_k, attention_mask)

    @torch.no_grad()
    def stats(self, attention_mask: torch.Tensor | None) -> dict[str, float]:
        """Token->expert balance of the recorded forward over its real tokens: each MoE layer's max_load_ratio
        (``router/layer_<i>/max_load_ratio``, i counting the MoE layers from 0), their mean and the worst layer's."""
        if not self._experts:
            return {}
        valid = None if attention_mask is None else attention_mask.reshape(-1).bool()
        ratios: dict[int, float] = {}
        for layer, experts in enumerate(self._experts):
            chosen = experts if valid is None else experts[valid[: experts.shape[0]]]
            if chosen.numel() == 0:
                continue
            load = torch.bincount(chosen.reshape(-1), minlength=self.num_experts).float()
            ratios[layer] = float(load.max() / load.sum() * self.num_experts)
        if not ratios:
            return {}
        values = list(ratios.values())
        width = len(str(len(self._experts) - 1))  # zero-padded, so the layers sort in order in a tracker
        return {"router/max_load_ratio": sum(values) / len(values), "router/max_load_ratio_worst_layer": max(values),
                **{f"router/layer_{layer:0{width}d}/max_load_ratio": r for layer, r in ratios.items()}}
