"""Causal SDPA for the training engine's packed attention, with the CPU bf16 backward computed in fp32.

Why: under bf16 autocast on CPU, torch's flash-attention kernel is fast in the forward but its bf16 backward makes
many small bf16 products whose per-call cost dominates at RL's sequence lengths (short rows: a GRPO micro-batch's);
the same kernel's fp32 backward is faster there and level at long rows (docs/benchmarks-history.md, fifteenth session).

So on CPU, for bf16 inputs that need gradients (no dropout), the forward is the same kernel call as SDPA's (the same
bits) and keeps its log-sum-exp; the backward is the same kernel's fp32 backward on the inputs and output cast up,
its gradients cast back to bf16. That is bf16's gradient computed with fp32 intermediates: at least as exact as the
bf16 kernel's (closer to the fp64 gradient in tests/engines/test_causal_attention.py). Everything else (fp32, no
gradient, dropout, other devices) is plain ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_attention", "sdpa_dtype"]


class _Bf16CausalFp32Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True,
                                                                             scale=scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.float(), query.float(), key.float(), value.float(), out.float(), lse, 0.0, True, scale=ctx.scale)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None


def sdpa_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype | None:
    """The dtype SDPA computes in here: CPU autocast's (it casts SDPA's inputs to it: under the engine's bf16
    autocast the rotary embedding leaves q and k in fp32 and v in bf16), else the inputs' own when they agree."""
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return query.dtype if key.dtype == value.dtype == query.dtype else None


def _fp32_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float) -> bool:
    """Whether this call takes the fp32 backward: CPU, bf16, gradients, no dropout, and operands the flash kernel
    takes (4-D, one head size for q, k and v; SDPA picks another kernel otherwise, and so is left to)."""
    return (query.device.type == "cpu" and sdpa_dtype(query, key, value) == torch.bfloat16 and dropout == 0.0
            and torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
            and query.dim() == key.dim() == value.dim() == 4 and query.shape[-1] == key.shape[-1] == value.shape[-1])


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float,
                     scale: float | None, gqa: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query [b, H, L, D], key/value [b, Hkv, L, D], is_causal=True)``; on CPU in
    bf16 (or under bf16 autocast) with gradients, its backward in fp32 (module docstring). Key/value heads may
    divide the query heads (GQA)."""
    if _fp32_backward(query, key, value, dropout):
        query, key, value = (t.to(torch.bfloat16) for t in (query, key, value))  # autocast's casts, as SDPA's
        with torch.autocast("cpu", enabled=False):
            return _Bf16CausalFp32Backward.apply(query, key, value, scale)
    return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scale,
                                          enable_gqa=gqa)
