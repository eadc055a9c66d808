"""Routed-expert MLP for the native decoder (Qwen3-MoE): top-k routing and batched expert dispatch.

The arithmetic is transformers' Qwen3MoeTopKRouter + Qwen3MoeExperts: router softmax in fp32, top-k, optional
renormalisation of the k weights, each chosen expert's gated MLP scaled by its weight and summed per token in expert
order. Dispatch groups the token-expert assignments by expert with one stable sort, so each expert runs one matmul
over all of its tokens; the only Python loop is over experts (a few dozen), never over tokens. How an expert's
matmuls run is the caller's (``expert_mlp``): plain F.linear on the fused tensors, or per-expert oneDNN-packed weights
on CPU (native_model.py) — at decode batch sizes the experts' matmuls are small and bound by reading the weights, so
their layout is what matters.

The group sizes are read on the host (``tolist``) to slice the sorted rows, which a CUDA graph cannot capture:
the native engine decodes MoE checkpoints eagerly or with the uncaptured fixed-shape step (native_rollout.py). A
compiled step (compiled_step.py) traces the routing and calls ``dispatch`` as one opaque op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["dense_experts", "dispatch", "moe_mlp", "route", "route_logits"]


def route(x: torch.Tensor, router: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router [E, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
    return route_logits(F.linear(x, router), k, normalize)


def route_logits(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits [T, E] -> (weights [T, k] in their dtype, expert ids [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def dense_experts(gate_up: torch.Tensor, down: torch.Tensor,
                  act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """expert_mlp for moe_mlp from the fused tensors: gate_up [E, 2I, H] (rows [gate | up]), down [E, H, I]."""

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
        return F.linear(act(gate) * up, down[expert])

    return expert_mlp


def moe_mlp(x: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
            expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],
            record: list[torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., H]; router [E, H]; ``expert_mlp(e, rows [n, H]) -> [n, H]`` expert e's gated MLP (``dense_experts``,
    or the decoder's packed weights) -> [..., H].

    `record`: a list that gets this call's chosen experts [T, k] (T = x's tokens, row-major), for routing replay.
    """
    lead, hidden = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, hidden)
    weights, experts = route(x, router, k, normalize)
    if record is not None:
        record.append(experts)
    return dispatch(x, weights, experts, router.shape[0], expert_mlp).view(*lead, hidden)


def dispatch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
             expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, H], routing weights and expert ids [T, k] (``route``) -> sum over each token's k experts of weight *
    expert_mlp(e, token) [T, H].

    Reads the group sizes on the host (a compiled step calls it as one op: compiled_step.routed_experts).
    """
    k = experts.shape[-1]
    flat = experts.reshape(-1)  # [T * k] assignment -> expert
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens ascending within each group
    token = order // k
    rows = x[token]
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            outputs.append(expert_mlp(expert, rows[start : start + count]))
        start += count
    y = torch.cat(outputs) * weights.reshape(-1)[order, None]
    # index_add_ in assignment order: each token's k contributions are summed in expert order, as transformers does
    return torch.zeros_like(x).index_add_(0, token, y)


class RouteRecorder:
    """The experts every token was routed to during one generate call, for routing replay in training.

    ``routes [rows, P + max_new, moe_layers, k]`` int16, in the output layout (prompt columns, then response
    columns); -1 where no forward ran: the last sampled token of a row is never fed back. The engine sets -1 at
    padding too (generate's output), which is routed in the batched forwards but belongs to no row.
    """

    def __init__(self, model, rows: int, prompt_len: int, max_new: int, n: int) -> None:
        s = model.shape
        self.model, self.n, self.prompt_len = model, n, prompt_len
        self.layers = sum(1 for layer in s.layers if layer.moe)
        self.routes = torch.full((rows, prompt_len + max_new, self.layers, s.experts_per_token), -1,
                                 dtype=torch.int16, device=model.device)

    def start(self) -> None:
        self.model.route_log = []

    def _collect(self) -> torch.Tensor:
        log, self.model.route_log = self.model.route_log, None
        if len(log) != self.layers:
            raise AssertionError(f"a forward recorded {len(log)} MoE layers' routes, the model has {self.layers}")
        return torch.stack(log, dim=1).to(torch.int16)  # [T, layers, k]

    def prefill_done(self, prompts: int) -> None:
        routes = self._collect().view(prompts, self.prompt_len, self.layers, -1)
        self.routes[:, : self.prompt_len] = routes.repeat_interleave(self.n, dim=0)

    def step_done(self, row_index: torch.Tensor, step: int) -> None:
        """The decode step that fed response token `step` of the running rows (output rows `row_index`)."""
        self.routes[row_index, self.prompt_len + step] = self._collect()
