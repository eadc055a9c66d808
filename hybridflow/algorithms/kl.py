"""KL divergence between the policy and the reference policy: per-token estimators, KL-in-reward, KL controllers.

Estimators of KL(pi || pi_ref) from samples of pi, per token, with log_ratio = log pi - log pi_ref (Schulman 2020,
"Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):
  "k1" / "kl"          log_ratio                                  unbiased, high variance, can be negative
  "k2" / "mse"         0.5 * log_ratio^2                          biased, low variance, >= 0
  "k3" / "low_var_kl"  exp(-log_ratio) - 1 + log_ratio            unbiased, low variance, >= 0; clamped to [-10, 10]
  "abs"                |log_ratio|
Straight-through variants, name + "+" (e.g. "k1+", "k3+", "low_var_kl+"): the VALUE of the named estimator with the
GRADIENT of k2, i.e. est + k2 - sg(k2). Why k2's gradient: with samples drawn from pi, E[grad k2] =
E[log_ratio * grad log pi] is the true gradient of KL(pi || pi_ref), while the gradients of k1 (E = 0) and k3 are
not — so a KL *loss* should use "k1+"/"k3+" to report the familiar value and still follow the right gradient.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import agg_loss
from hybridflow.algorithms.masked import masked_mean

# Keeps exp(-log_ratio) finite; beyond this the two policies have nothing in common anyway.
KL_LOG_RATIO_CLAMP = 20.0
# k3 bound, as in common practice: a few outlier tokens must not dominate the penalty.
K3_CLAMP = 10.0

_ALIASES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
KL_TYPES = (*_ALIASES, *(name + "+" for name in _ALIASES))


def _estimator(log_ratio: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        clamped = torch.clamp(log_ratio, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(-clamped) - 1.0 + clamped, -K3_CLAMP, K3_CLAMP)
    return log_ratio.abs()  # "abs"


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate -> same shape as log_prob (e.g. [B, T]); see the module docstring."""
    straight_through = kl_type.endswith("+")
    kind = _ALIASES.get(kl_type[:-1] if straight_through else kl_type)
    if kind is None:
        raise ValueError(f"unknown kl_type {kl_type!r}; known: {', '.join(KL_TYPES)}")
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)} and ref_log_prob {tuple(ref_log_prob.shape)} differ in shape"
        )
    log_ratio = log_prob - ref_log_prob
    value = _estimator(log_ratio, kind)
    if not straight_through:
        return value
    k2 = _estimator(log_ratio, "k2")
    return value.detach() + k2 - k2.detach()


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_type: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward (Ziegler et al. 2019): r_t = score_t - kl_coef * KL_t on valid tokens -> ([B, T], metrics).

    metrics["actor/reward_kl_penalty"] is the batch mean of the per-sequence mean KL: feed it to the KL controller's
    `update(current_kl, n_steps=batch_size)`. metrics["actor/reward_kl_penalty_coeff"] is the coefficient used.
    """
    mask = response_mask.to(token_level_scores.dtype)
    with torch.no_grad():
        kld = kl_penalty(old_log_prob, ref_log_prob, kl_type).to(token_level_scores.dtype) * mask
        token_level_rewards = token_level_scores - kl_coef * kld
        per_sequence = masked_mean(kld, mask, dim=-1)  # [B]
        current_kl = float(per_sequence.mean().item()) if per_sequence.numel() else 0.0
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(kl_coef)}
    return token_level_rewards, metrics


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_type: str = "low_var_kl",
    *,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL as a loss term (GRPO, Shao et al. 2024): agg_loss(kl_penalty(log_prob, ref_log_prob, kl_type)) -> ([], metrics).

    The actor adds kl_loss_coef * loss to the policy loss instead of putting KL in the reward. Inputs [B, T];
    metrics["kl_loss"] is the plain mean over this batch's valid tokens. "k3+" / "low_var_kl+" report k3 and follow
    the unbiased k2 gradient (see the module docstring).
    """
    kld = kl_penalty(log_prob, ref_log_prob, kl_type)
    loss = agg_loss(
        kld,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_length=norm_length,
    )
    return loss, {"kl_loss": float(masked_mean(kld.detach(), response_mask.to(kld.dtype)).item())}


class FixedKLController:
    """A constant KL coefficient (`.value`); `update` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of the KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    e = clip(current_kl / target_kl - 1, -0.2, 0.2);  value <- value * (1 + e * n_steps / horizon).
    The coefficient grows while the measured KL is above target and shrinks while below.
    """

    ERROR_CLIP = 0.2

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL controller needs target_kl > 0 and horizon > 0, got target_kl={target_kl}, "
                f"horizon={horizon}; fix algorithm.kl_ctrl in the config"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -self.ERROR_CLIP), self.ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def get_kl_controller(
    kl_ctrl_type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """A "fixed" or "adaptive" KL controller starting at kl_coef."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl_type {kl_ctrl_type!r}; known: fixed, adaptive")
