"""Train-inference mismatch: how far the rollout's log-probs are from the training engine's for the same tokens."""

from __future__ import annotations

import torch

__all__ = ["logprob_mismatch"]


def logprob_mismatch(
    rollout_log_probs: torch.Tensor, train_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Compare two sets of per-token log-probs [batch, response_len] over the valid tokens of response_mask.

    Returns floats: ``mismatch/mean_abs`` and ``mismatch/max_abs`` of |rollout - train|, and ``mismatch/kl``, the k3
    estimate of KL(rollout || train) on tokens sampled by the rollout: mean of exp(d) - 1 - d with d = train - rollout
    (unbiased, never negative). All are 0.0 when the mask is empty.
    """
    if rollout_log_probs.shape != train_log_probs.shape or rollout_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"logprob_mismatch needs equal shapes, got rollout {tuple(rollout_log_probs.shape)}, train "
            f"{tuple(train_log_probs.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    valid = response_mask.bool()
    if not valid.any():
        return {"mismatch/mean_abs": 0.0, "mismatch/max_abs": 0.0, "mismatch/kl": 0.0}
    d = (train_log_probs.double() - rollout_log_probs.double().to(train_log_probs.device))[valid.to(train_log_probs.device)]
    return {
        "mismatch/mean_abs": float(d.abs().mean()),
        "mismatch/max_abs": float(d.abs().max()),
        "mismatch/kl": float((torch.expm1(d) - d).mean()),
    }
