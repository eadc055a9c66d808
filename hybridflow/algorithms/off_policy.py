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
* Veto (``veto_threshold``, veRL's rollout_token_veto_threshold): a sequence with any token whose unclamped rho_t is
  below the threshold gets weight 0 on every token (one catastrophic token rejects its whole sample), whatever the
  other settings.
* Batch normalisation (``batch_normalize``, veRL's rollout_is_batch_normalize): the truncated IS weights are divided
  by their mean over the whole batch (over valid tokens at token level, over rows at sequence level), so they average
  1; applied before rejection and veto, which only zero weights. The mean comes from `is_weight_batch_stats` summed
  over every rank (the worker does that before the update), or, when not given, from the rows of the call itself.

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
    veto_threshold: float | None = None  # None: no veto
    batch_normalize: bool = False  # IS weights divided by their batch mean (needs is_level)

    @property
    def enabled(self) -> bool:
        return self.is_level is not None or self.rs_level is not None or self.veto_threshold is not None

    def band(self) -> tuple[float, float]:
        upper = self.rs_upper if self.rs_upper is not None else self.is_threshold
        lower = self.rs_lower if self.rs_lower is not None else 1.0 / upper
        return lower, upper


def _truncated_is_weights(log_rho: torch.Tensor, seq_log_rho: torch.Tensor, settings: CorrectionSettings
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] min(rho, threshold) at the IS level, [B, T] where rho was over the threshold)."""
    level_log = log_rho if settings.is_level == "token" else seq_log_rho.expand_as(log_rho)
    cap = math.log(settings.is_threshold)
    return torch.exp(level_log.clamp(max=cap)), level_log > cap


def _log_ratios(old_log_probs, rollout_log_probs, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unclamped [B, T] log rho_t, clamped [B, T] log rho_t, clamped [B, 1] sequence log rho), zero on padding."""
    raw = (old_log_probs - rollout_log_probs).detach() * mask
    log_rho = raw.clamp(-_LOG_CLAMP, _LOG_CLAMP)
    return raw, log_rho, log_rho.sum(-1, keepdim=True).clamp(-_LOG_CLAMP, _LOG_CLAMP)


def is_weight_batch_stats(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                          settings: CorrectionSettings) -> torch.Tensor:
    """float64 [2]: (sum, count) of the truncated IS weights of these rows — over valid tokens (token level) or over
    rows with tokens (sequence level, one weight per row). Summed over ranks, sum / count is the batch mean."""
    mask = mask.to(old_log_probs.dtype)
    _, log_rho, seq_log_rho = _log_ratios(old_log_probs, rollout_log_probs, mask)
    weights, _ = _truncated_is_weights(log_rho, seq_log_rho, settings)
    if settings.is_level == "token":
        return torch.stack([(weights * mask).sum(), mask.sum()]).double()
    rows = mask.sum(-1) > 0
    return torch.stack([weights[:, 0][rows].sum(), rows.sum().to(weights.dtype)]).double()


def rollout_correction_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, settings: CorrectionSettings,
    is_batch_mean: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] log pi_old, [B, T] log pi_rollout, [B, T] mask -> ([B, T] weights, metrics). See the module docstring.

    is_batch_mean: with batch_normalize, the batch's mean truncated IS weight (None: these rows' own mean).
    Metrics: ``is_weight_mean`` / ``is_weight_max`` (over valid tokens, after truncation and rejection),
    ``is_truncated_fraction`` (tokens or sequences whose rho exceeded the threshold), ``rs_masked_fraction``,
    ``veto_fraction`` (rows with tokens that a token's veto rejected), ``is_batch_mean``.
    """
    mask = mask.to(old_log_probs.dtype)
    raw_log_rho, log_rho, seq_log_rho = _log_ratios(old_log_probs, rollout_log_probs, mask)
    has_tokens = mask.sum(-1) > 0
    weights = torch.ones_like(log_rho)
    metrics: dict[str, float] = {}
    if settings.is_level is not None:
        weights, over = _truncated_is_weights(log_rho, seq_log_rho, settings)
        metrics["is_truncated_fraction"] = _fraction(over, mask, settings.is_level, has_tokens)
        if settings.batch_normalize:
            if is_batch_mean is None:
                total, count = is_weight_batch_stats(old_log_probs, rollout_log_probs, mask, settings).tolist()
                is_batch_mean = total / count if count else 1.0
            weights = weights / max(is_batch_mean, 1e-12)
            metrics["is_batch_mean"] = float(is_batch_mean)
    if settings.rs_level is not None:
        lower, upper = settings.band()
        level_log = log_rho if settings.rs_level == "token" else seq_log_rho.expand_as(log_rho)
        low = math.log(lower) if lower > 0 else -math.inf
        outside = (level_log < low) | (level_log > math.log(upper))
        weights = weights * (~outside).to(weights.dtype)
        metrics["rs_masked_fraction"] = _fraction(outside, mask, settings.rs_level, has_tokens)
    if settings.veto_threshold is not None:
        vetoed = ((raw_log_rho < math.log(settings.veto_threshold)) & (mask > 0)).any(-1, keepdim=True)  # [B, 1]
        weights = weights * (~vetoed).to(weights.dtype)
        metrics["veto_fraction"] = float((vetoed[:, 0] & has_tokens).sum()) / max(int(has_tokens.sum()), 1)
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
