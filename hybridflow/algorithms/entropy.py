"""Entropy of the policy's next-token distribution, from logits.

H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v, for p = softmax(z). The vocabulary is large (~150k), so a
[batch * seq, V] float32 softmax is the biggest tensor of an actor step; `entropy_from_logits_chunked` never holds more
than [chunk_size, V] of it, in the forward AND the backward pass (a custom autograd function recomputes the softmax
per chunk instead of saving it), and gives the same value and gradient as the plain version.
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision softmax loses the small probabilities that entropy is made of: compute in at least float32.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) over the last dim: [..., V] -> [...] (float32 for half-precision input)."""
    z = logits.to(_compute_dtype(logits.dtype))
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy over rows of [N, V] logits, chunk by chunk; saves only the logits for backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=_compute_dtype(logits.dtype), device=logits.device)
        for start in range(0, logits.shape[0], chunk_size):
            out[start : start + chunk_size] = entropy_from_logits(logits[start : start + chunk_size])
        ctx.save_for_backward(logits)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (logits,) = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            z = logits[start : start + ctx.chunk_size].to(_compute_dtype(logits.dtype))
            log_p = torch.log_softmax(z, dim=-1)
            p = log_p.exp()
            entropy = -(p * log_p).sum(dim=-1, keepdim=True)
            # dH/dz_j = -p_j (log p_j + H)
            g = -p * (log_p + entropy) * grad_out[start : start + ctx.chunk_size].unsqueeze(-1)
            grad[start : start + ctx.chunk_size] = g.to(logits.dtype)
        return grad, None


def entropy_from_logits_chunked(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """Exact entropy of softmax(logits) per row, [N, V] -> [N], computed `chunk_size` rows at a time.

    Differentiable; peak extra memory ~ chunk_size * V floats in both passes. Other shapes [..., V] are flattened
    and the result reshaped to [...].
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    leading = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedEntropy.apply(flat, chunk_size).reshape(leading)
