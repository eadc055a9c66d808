"""Statistics over the valid (mask == 1) entries of a tensor.

Masks are 0/1 tensors (bool, int or float) of the same shape as the data; masked entries never enter a statistic,
whatever value (even inf or NaN) they hold. An empty mask gives 0, not NaN.
"""

from __future__ import annotations

import torch

# Added to the variance before the reciprocal square root when whitening, so a constant input gives 0, not NaN.
WHITEN_EPS = 1e-8


def _as_weights(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.shape != like.shape:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but the data has shape {tuple(like.shape)}; they must match"
        )
    return mask.to(dtype=like.dtype)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over valid entries; over all dims (-> []) or along `dim` (that dim removed)."""
    weights = _as_weights(mask, x)
    # where() rather than x * weights, so garbage (inf) in masked positions cannot leak in as inf * 0 = NaN.
    valid = torch.where(weights != 0, x * weights, torch.zeros_like(x))
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over valid entries; over all dims (-> []) or along `dim`. An empty mask gives 0."""
    weights = _as_weights(mask, x)
    count = weights.sum() if dim is None else weights.sum(dim=dim)
    # For 0/1 masks a non-empty count is >= 1, so the clamp only changes the empty case (0 / tiny = 0).
    return masked_sum(x, weights, dim) / count.clamp_min(torch.finfo(x.dtype).tiny)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance (divide by n, not n - 1) of x over all valid entries -> []."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with mean and population variance over the valid entries of the whole tensor.

    Same shape as x; masked entries are transformed too (callers zero them). shift_mean=False adds the mean back,
    i.e. only rescales. A constant input gives 0 (or the mean), never NaN.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean
