"""The actor and critic objectives, composed from the config in one place (the workers only run them).

    ctx = LossContext(loss_agg_mode="token-mean", global_num_tokens=..., global_num_seqs=..., norm_length=R)
    objective = build_actor_objective(ActorLossConfig(policy_loss="ppo", entropy_coeff=0.001, use_kl_loss=True))
    loss, metrics = objective(batch_tensors, log_prob, entropy, ctx)

The actor objective is  w * policy loss  - entropy_coeff * entropy  + kl_loss_coef * KL(pi || pi_ref), each term a
per-token matrix [B, T] reduced by the same `LossContext` (one aggregation mode, the mini-batch's global counts), so
the sum over micro-batches and ranks is the mini-batch loss whatever the split. w is 1, or the off-policy correction
(off_policy.py: truncated importance weights pi_old / pi_rollout and/or rejection outside a band, per token or per
sequence) when ``correction`` is on; with recomputed old log-probs that is decoupled PPO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from hybridflow.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from hybridflow.algorithms.kl import KL_TYPES, kl_loss
from hybridflow.algorithms.masked import masked_mean
from hybridflow.algorithms.off_policy import LEVELS, CorrectionSettings, rollout_correction_weights
from hybridflow.algorithms.registry import PolicyLossSettings, get_policy_loss
from hybridflow.algorithms.value_loss import compute_value_loss

__all__ = [
    "ActorLossConfig",
    "ActorObjective",
    "CriticLossConfig",
    "CriticObjective",
    "LossContext",
    "build_actor_objective",
    "build_critic_objective",
]


@dataclass(frozen=True)
class LossContext:
    """How per-token losses of one micro-batch become its share of the mini-batch loss.

    global_num_tokens / global_num_seqs: valid tokens / rows of the whole mini-batch over every micro-batch and rank
    (None: this micro-batch is the whole mini-batch). norm_length: Dr. GRPO's constant length (default: T).
    """

    loss_agg_mode: str = "token-mean"
    global_num_tokens: float | None = None
    global_num_seqs: float | None = None
    norm_length: float | None = None
    # the whole batch's mean truncated IS weight (off_policy.py batch_normalize); None: the micro-batch's own
    is_batch_mean: float | None = None

    def aggregate(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [] (this micro-batch's share; see aggregation.py)."""
        return agg_loss(
            loss_mat,
            mask,
            self.loss_agg_mode,
            global_num_tokens=self.global_num_tokens,
            global_num_seqs=self.global_num_seqs,
            norm_length=self.norm_length,
        )

    def local_value(self, share: torch.Tensor, mask: torch.Tensor) -> float:
        """A micro-batch's share of the mini-batch loss turned back into that micro-batch's own mean (for logging)."""
        if self.loss_agg_mode == "token-mean":
            total, local = self.global_num_tokens, float(mask.sum())
        else:
            total, local = self.global_num_seqs, float(mask.shape[0])
        return float(share) * (float(total) / local if total and local else 1.0)


@dataclass(frozen=True)
class ActorLossConfig:
    """The actor's loss settings (veRL's actor keys); `policy_loss` is a registered name or an import path."""

    policy_loss: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    correction: CorrectionSettings = field(default_factory=CorrectionSettings)  # off by default

    def errors(self) -> list[str]:
        """What is invalid, as 'key: reason' messages (keys relative to actor_rollout_ref.actor)."""
        out = []
        if self.clip_ratio_c <= 1.0:
            out.append(f"clip_ratio_c={self.clip_ratio_c} (the dual-clip bound) must be > 1")
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            out.append(f"clip ratios must be >= 0, got low={self.clip_ratio_low} high={self.clip_ratio_high}")
        if self.use_kl_loss and self.kl_loss_type not in KL_TYPES:
            out.append(f"kl_loss_type={self.kl_loss_type!r} is unknown; choose one of {list(KL_TYPES)}")
        for level in (self.correction.is_level, self.correction.rs_level):
            if level is not None and level not in LEVELS:
                out.append(f"off-policy correction level {level!r} is unknown; choose one of {list(LEVELS)}")
        return out


class ActorObjective:
    """policy loss - entropy_coeff * entropy + kl_loss_coef * KL; see the module docstring.

    needs_entropy: the forward must return per-token entropy; needs_ref: the batch must hold ref_log_probs.
    """

    def __init__(self, config: ActorLossConfig):
        self.config = config
        self.policy_loss = get_policy_loss(config.policy_loss)
        self.settings = PolicyLossSettings(config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c)
        self.needs_entropy = config.entropy_coeff != 0
        self.needs_ref = config.use_kl_loss

    def __call__(
        self,
        batch: Mapping[str, torch.Tensor],
        log_prob: torch.Tensor,
        entropy: torch.Tensor | None,
        ctx: LossContext,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """batch: response_mask, advantages [B, T] and, where present, old_log_probs / ref_log_probs [B, T];
        rollout_log_probs [B, T] when the off-policy correction is on.

        Without old_log_probs the update is on-policy: the old policy is this forward, detached.
        """
        c = self.config
        mask = batch["response_mask"].to(log_prob.dtype)
        old = batch["old_log_probs"] if "old_log_probs" in batch else log_prob.detach()
        pg_losses, metrics = self.policy_loss.per_token(old, log_prob, batch["advantages"], mask, self.settings)
        metrics = {k: float(v) for k, v in metrics.items()}
        if c.correction.enabled:
            if "rollout_log_probs" not in batch:
                raise ValueError(
                    "algorithm.rollout_correction needs the rollout's log-probs (rollout_log_probs) in the batch; "
                    "this rollout engine did not return them"
                )
            weights, corr = rollout_correction_weights(old, batch["rollout_log_probs"], mask, c.correction,
                                                       ctx.is_batch_mean)
            pg_losses = pg_losses * weights
            metrics.update({f"rollout_correction/{k}": v for k, v in corr.items()})
        pg_loss = ctx.aggregate(pg_losses, mask)
        loss = pg_loss
        metrics["pg_loss"] = ctx.local_value(pg_loss.detach(), mask)
        if entropy is not None:
            metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
            if self.needs_entropy:
                loss = loss - c.entropy_coeff * ctx.aggregate(entropy, mask)
        if self.needs_ref:
            kl, kl_metrics = kl_loss(
                log_prob, batch["ref_log_probs"], mask, c.kl_loss_type,
                loss_agg_mode=ctx.loss_agg_mode, global_num_tokens=ctx.global_num_tokens,
                global_num_seqs=ctx.global_num_seqs, norm_length=ctx.norm_length,
            )
            loss = loss + c.kl_loss_coef * kl
            metrics.update(kl_metrics)
        return loss, metrics


def build_actor_objective(config: ActorLossConfig) -> ActorObjective:
    """The actor objective for these settings; ValueError naming what is wrong."""
    problems = config.errors()
    if problems:
        raise ValueError("invalid actor loss settings: " + "; ".join(problems))
    return ActorObjective(config)


@dataclass(frozen=True)
class CriticLossConfig:
    cliprange_value: float | None = 0.5  # None: no value clipping


class CriticObjective:
    """Clipped value loss over response tokens (value_loss.py), reduced by the LossContext."""

    def __init__(self, config: CriticLossConfig):
        self.config = config

    def __call__(
        self, batch: Mapping[str, torch.Tensor], values: torch.Tensor, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """batch: response_mask, values (the old values), returns [B, T]; values: this forward's V [B, T]."""
        mask = batch["response_mask"].to(values.dtype)
        loss, metrics = compute_value_loss(
            values, batch["values"], batch["returns"], mask, cliprange_value=self.config.cliprange_value,
            loss_agg_mode=ctx.loss_agg_mode, global_num_tokens=ctx.global_num_tokens,
            global_num_seqs=ctx.global_num_seqs, norm_length=ctx.norm_length,
        )
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["vf_loss"] = ctx.local_value(loss.detach(), mask)
        return loss, metrics


def build_critic_objective(config: CriticLossConfig) -> CriticObjective:
    return CriticObjective(config)


def check_loss_agg_mode(mode: str) -> str | None:
    """None, or why `mode` is not an aggregation mode."""
    return None if mode in LOSS_AGG_MODES else f"loss_agg_mode={mode!r} is unknown; choose one of {list(LOSS_AGG_MODES)}"
