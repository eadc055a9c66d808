"""Policy-gradient losses: (old_log_prob, log_prob, advantages, response_mask) [B, T], settings -> (per-token loss
[B, T], metrics).

All take the same arguments (`PolicyLossSettings` holds the clip ranges; a loss ignores what it does not use) and
return the per-token loss matrix; the caller reduces it once (objective.py's LossContext over aggregation.py's modes
and global counts), so the reduction is written in one place, not in every loss. Metrics are floats over this
batch's valid tokens:
  pg_clipfrac        fraction of tokens whose ratio was clipped (the clipped branch is the active one)
  pg_clipfrac_lower  fraction of tokens where the lower bound bites (PPO: dual-clip cap; GSPO: s < 1 - eps_low with
                     A < 0; CISPO: ratio < 1 - eps_low; REINFORCE: 0)
  ppo_kl             mean of log pi_old - log pi (the k1 estimate of KL(pi_old || pi) on old samples)
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.masked import masked_mean
from hybridflow.algorithms.registry import POLICY_LOSSES, PolicyLossSettings, register_policy_loss

# exp() of a log-ratio beyond +-20 overflows float16/bfloat16 ranges and means the sample is far off-policy anyway.
LOG_RATIO_CLAMP = 20.0


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _metric(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(x.detach().to(mask.dtype), mask).item())


Loss = tuple[torch.Tensor, dict[str, float]]


@register_policy_loss("ppo")
def ppo(old_log_prob, log_prob, advantages, mask, s: PolicyLossSettings) -> Loss:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher and dual-clip.

    ratio r = exp(log_prob - old_log_prob); per token L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)).
    Clip-higher (DAPO, Yu et al. 2025): eps_low and eps_high are separate (e.g. 0.2 / 0.28).
    Dual-clip (Ye et al. 2020): for A < 0 the loss is additionally capped at -A c (c = clip_ratio_c > 1), so a huge
    ratio on a bad action cannot produce an unbounded step; for A >= 0 it is not applied.
    """
    if s.clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip constant) must be > 1, got {s.clip_ratio_c}")
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - s.clip_ratio_low, 1.0 + s.clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * s.clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_cap), clip_loss)
    return pg_losses, {
        "pg_clipfrac": _metric(clipped > unclipped, mask),
        "pg_clipfrac_lower": _metric((clip_loss > dual_cap) & negative, mask),
        "ppo_kl": _metric(-log_ratio, mask),
    }


@register_policy_loss(
    "gspo", recommended={"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}
)
def gspo(old_log_prob, log_prob, advantages, mask, s: PolicyLossSettings) -> Loss:
    """GSPO (Zheng et al. 2025): clip a sequence-level importance ratio s_i = exp(mean_t log(pi / pi_old)).

    Token form (the paper's GSPO-token): s_{i,t} = sg(s_i) * pi_t / sg(pi_t), so every token carries the value s_i
    and the gradient s_i * grad log pi_t; with seq-mean-token-mean aggregation and a per-sequence advantage this is
    exactly the gradient of the sequence-level objective. Per token L = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)).
    The paper's clip ranges are tiny because s_i is a per-token geometric mean: 3e-4 / 4e-4 (`recommended`; the
    trainer passes its configured clip_ratio_low/high, so set them for GSPO).
    """
    log_ratio = _log_ratio(old_log_prob, log_prob)
    lengths = mask.sum(dim=-1).clamp_min(1.0)
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / lengths  # [B], log s_i
    # value: log s_i on every token; gradient: that of log pi_t alone (per-token, as in GSPO-token).
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * seq_ratio
    clipped = -advantages * torch.clamp(seq_ratio, 1.0 - s.clip_ratio_low, 1.0 + s.clip_ratio_high)
    return torch.maximum(unclipped, clipped), {
        "pg_clipfrac": _metric(clipped > unclipped, mask),
        "pg_clipfrac_lower": _metric((seq_ratio < 1.0 - s.clip_ratio_low) & (advantages < 0), mask),
        "ppo_kl": _metric(-log_ratio, mask),
    }


@register_policy_loss("cispo")
def cispo(old_log_prob, log_prob, advantages, mask, s: PolicyLossSettings) -> Loss:
    """CISPO (MiniMax-M1, 2025): L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi.

    Unlike PPO, clipping bounds the importance-sampling WEIGHT, never the gradient: every token keeps a gradient
    -w A grad log pi, so rare high-ratio tokens (often the "reflection" tokens) are down-weighted, not dropped.
    The paper uses a large eps_low (effectively no lower bound) and tunes only eps_high.
    """
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - s.clip_ratio_low, 1.0 + s.clip_ratio_high).detach()
    below = ratio < 1.0 - s.clip_ratio_low
    return -weight * advantages * log_prob, {
        "pg_clipfrac": _metric(below | (ratio > 1.0 + s.clip_ratio_high), mask),
        "pg_clipfrac_lower": _metric(below, mask),
        "ppo_kl": _metric(-log_ratio, mask),
    }


@register_policy_loss("reinforce")
def reinforce(old_log_prob, log_prob, advantages, mask, s: PolicyLossSettings) -> Loss:
    """Vanilla REINFORCE (Williams 1992): L = -A * log pi, no importance weight or clipping (on-policy only).

    old_log_prob only feeds the ppo_kl metric, which should stay ~0 if the data really is on-policy.
    """
    return -advantages * log_prob, {
        "pg_clipfrac": 0.0,
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": _metric(-_log_ratio(old_log_prob, log_prob), mask),
    }


POLICY_LOSSES.add("vanilla", ppo)  # veRL's name for the PPO clip loss (actor.policy_loss.loss_mode=vanilla)
