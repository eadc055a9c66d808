"""Critic loss with value clipping, and the explained-variance diagnostic."""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import agg_loss
from hybridflow.algorithms.masked import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss (PPO, Schulman et al. 2017; as in the OpenAI baselines implementation) -> (loss [], metrics).

    All inputs [B, T]. V_clip = V_old + clip(V - V_old, -c, c); per token 0.5 * max((V - R)^2, (V_clip - R)^2), reduced
    with `agg_loss`. cliprange_value=None disables clipping. metrics: "vf_clipfrac" (fraction of tokens where the
    clipped term is the larger one), "vpred_mean".
    """
    if not (vpreds.shape == old_values.shape == returns.shape == response_mask.shape):
        raise ValueError(
            f"value loss inputs must all be [batch, response_len]; got vpreds={tuple(vpreds.shape)}, "
            f"old_values={tuple(old_values.shape)}, returns={tuple(returns.shape)}, "
            f"response_mask={tuple(response_mask.shape)}"
        )
    mask = response_mask.to(vpreds.dtype)
    unclipped = (vpreds - returns) ** 2
    if cliprange_value is None:
        losses, clipped_active = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        vpred_clipped = old_values + torch.clamp(vpreds - old_values, -cliprange_value, cliprange_value)
        clipped = (vpred_clipped - returns) ** 2
        losses, clipped_active = torch.maximum(unclipped, clipped), clipped > unclipped
    loss = 0.5 * agg_loss(
        losses,
        mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_length=norm_length,
    )
    metrics = {
        "vf_clipfrac": float(masked_mean(clipped_active.to(mask.dtype), mask).item()),
        "vpred_mean": float(masked_mean(vpreds.detach(), mask).item()),
    }
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over valid tokens (population variances).

    1 is a perfect critic, 0 no better than a constant, < 0 worse. NaN when the returns have no variance (undefined).
    """
    values = values.detach().to(returns.dtype)
    m = mask.to(returns.dtype)

    def var(x: torch.Tensor) -> torch.Tensor:
        return masked_mean((x - masked_mean(x, m)) ** 2, m)

    var_returns = float(var(returns).item())
    if var_returns == 0.0:
        return float("nan")
    return 1.0 - float(var(returns - values).item()) / var_returns
