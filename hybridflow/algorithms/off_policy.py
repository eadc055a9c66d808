"""Off-policy corrections from the rollout's own log-probs: truncated importance sampling (TIS) and rejection (MIS).

The samples of a step come from the behaviour policy pi_rollout (the rollout engine: older weights in the
overlapped modes, other kernels or int8 weights always). With ``old_log_probs`` from the training engine (pi_old),

    rho_t = pi_old(y_t) / pi_rollout(y_t)                          per token
    rho   = prod_t rho_t  over the row's response tokens            per sequence

* TIS (``level="token"`` / ``"sequence"``): each token's policy loss is multiplied by min(rho, threshold), detached
  (Ionides 2008's truncation; Yao et al. 2025 for LLM rollouts). With pi_old recomputed by the trainer this is the
  decoupled PPO objective (Hilton et al. 2022): the clip is taken around the proximal policy pi_old, the importance
  weight corrects for the behaviour policy.
* MIS / rejection (``rs_level``): tokens (or whole sequences) whose rho leaves [lower, upper] get weight 0. The loss
  normaliser is unchanged (the mini-batch's token/sequence counts), so rejected tokens shrink the step rather than
  re-weighting the rest.

Weights are [B, T], zero on padding; nothing here has a gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LEVELS = ("token", "sequence")
_LOG_CLAMP = 20.0  # exp(+-20): a ratio beyond it is truncated / rejected anyway, and exp must not overflow


@dataclass(frozen=True)
class CorrectionSettings:
    """veRL's algorithm.rollout_correction keys; is_level / rs_level None: that correction is off."""

    is_level: str | None = None
    is_threshold: float = 2.0
    rs_level: str | None = None
    rs_upper: float | None = None  # None: is_threshold
    rs_lower: float | None = None  # None: 1 / rs_upper

    @property
    def enabled(self) -> bool:
        return self.is_level is not None or self.rs_level is not None

    def band(self) -> tuple[float, float]:
        upper = self.rs_upper if self.rs_upper is not None else self.is_threshold
        lower = self.rs_lower if self.rs_lower is not None else 1.0 / upper
        return lower, upper


def rollout_correction_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, settings: CorrectionSettings
) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] log pi_old, [B, T] log pi_rollout, [B, T] mask -> ([B, T] weights, metrics). See the module docstring.

    Metrics: ``is_weight_mean`` / ``is_weight_max`` (over valid tokens, after truncation and rejection),
    ``is_truncated_fraction`` (tokens or sequences whose rho exceeded the threshold), ``rs_masked_fraction``.
    """
    mask = mask.to(old_log_probs.dtype)
    log_rho = ((old_log_probs - rollout_log_probs).detach() * mask).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    seq_log_rho = log_rho.sum(-1, keepdim=True).clamp(-_LOG_CLAMP, _LOG_CLAMP)  # [B, 1]
    has_tokens = mask.sum(-1) > 0
    weights = torch.ones_like(log_rho)
    metrics: dict[str, float] = {}
    if settings.is_level is not None:
        level_log = log_rho if settings.is_level == "token" else seq_log_rho.expand_as(log_rho)
        cap = math.log(settings.is_threshold)
        weights = torch.exp(level_log.clamp(max=cap))
        over = level_log > cap
        metrics["is_truncated_fraction"] = _fraction(over, mask, settings.is_level, has_tokens)
    if settings.rs_level is not None:
        lower, upper = settings.band()
        level_log = log_rho if settings.rs_level == "token" else seq_log_rho.expand_as(log_rho)
        low = math.log(lower) if lower > 0 else -math.inf
        outside = (level_log < low) | (level_log > math.log(upper))
        weights = weights * (~outside).to(weights.dtype)
        metrics["rs_masked_fraction"] = _fraction(outside, mask, settings.rs_level, has_tokens)
    weights = weights * mask
    valid = mask > 0
    if valid.any():
        metrics["is_weight_mean"] = float(weights[valid].mean())
        metrics["is_weight_max"] = float(weights[valid].max())
    return weights, metrics


def _fraction(flags: torch.Tensor, mask: torch.Tensor, level: str, has_tokens: torch.Tensor) -> float:
    """Share of valid tokens (token level) or of rows with tokens (sequence level) that are flagged."""
    if level == "token":
        return float((flags.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1))
    rows = flags[:, 0] & has_tokens
    return float(rows.sum()) / max(int(has_tokens.sum()), 1)
