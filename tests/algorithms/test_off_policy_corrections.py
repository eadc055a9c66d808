"""Off-policy corrections (TIS, rejection, decoupled PPO) against plain loops written from the definitions."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.objective import ActorLossConfig, LossContext, build_actor_objective
from hybridflow.algorithms.off_policy import CorrectionSettings, rollout_correction_weights

SEEDS = range(4)
TOL = 1e-9


def ref_weights(old, rollout, mask, s: CorrectionSettings):
    """rho_t = exp(old_t - rollout_t); rho = prod over valid t; TIS min(rho, cap); rejection outside [lo, hi]."""
    B, T = mask.shape
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        valid = [t for t in range(T) if mask[i][t] > 0]
        seq_rho = math.exp(sum(float(old[i][t] - rollout[i][t]) for t in valid))
        for t in valid:
            tok_rho = math.exp(float(old[i][t] - rollout[i][t]))
            w = 1.0
            if s.is_level is not None:
                w = min(tok_rho if s.is_level == "token" else seq_rho, s.is_threshold)
            if s.rs_level is not None:
                lo, hi = s.band()
                rho = tok_rho if s.rs_level == "token" else seq_rho
                if not lo <= rho <= hi:
                    w = 0.0
            out[i][t] = w
    return torch.tensor(out, dtype=torch.float64)


SETTINGS = [
    CorrectionSettings(is_level="token", is_threshold=1.2),
    CorrectionSettings(is_level="sequence", is_threshold=1.5),
    CorrectionSettings(rs_level="token", rs_upper=1.3, rs_lower=0.8),
    CorrectionSettings(rs_level="sequence", rs_upper=2.0),
    CorrectionSettings(is_level="token", is_threshold=2.0, rs_level="sequence", rs_upper=3.0, rs_lower=0.5),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"is={s.is_level}-rs={s.rs_level}")
def test_weights_match_the_loop(make_batch, seed, settings):
    b = make_batch(seed)
    # the rollout's log-probs: the behaviour policy, a little off the old policy
    rollout = b.old_log_prob + 0.25 * torch.randn(b.shape, generator=torch.Generator().manual_seed(seed),
                                                  dtype=torch.float64)
    got, metrics = rollout_correction_weights(b.old_log_prob, rollout, b.response_mask, settings)
    want = ref_weights(b.old_log_prob, rollout, b.response_mask, settings)
    assert torch.allclose(got, want, atol=TOL, rtol=TOL)
    valid = b.response_mask > 0
    assert metrics["is_weight_mean"] == pytest.approx(float(want[valid].mean()), abs=TOL)
    assert metrics["is_weight_max"] == pytest.approx(float(want[valid].max()), abs=TOL)
    if settings.rs_level == "token":
        lo, hi = settings.band()
        rho = torch.exp(b.old_log_prob - rollout)[valid]
        assert metrics["rs_masked_fraction"] == pytest.approx(float(((rho < lo) | (rho > hi)).double().mean()))
    if settings.is_level == "token":
        rho = torch.exp(b.old_log_prob - rollout)[valid]
        assert metrics["is_truncated_fraction"] == pytest.approx(float((rho > settings.is_threshold).double().mean()))


def ref_decoupled_ppo(old, new, rollout, adv, mask, low, high, cap):
    """Hilton et al. 2022 (decoupled PPO), token-mean: clip around the proximal pi_old, weight by
    min(pi_old / pi_behaviour, cap) truncated (TIS), averaged over valid tokens."""
    total, count = 0.0, 0
    B, T = mask.shape
    for i in range(B):
        for t in range(T):
            if mask[i][t] <= 0:
                continue
            ratio = math.exp(float(new[i][t] - old[i][t]))
            a = float(adv[i][t])
            clipped = max(-a * ratio, -a * min(max(ratio, 1 - low), 1 + high))
            if a < 0:
                clipped = min(clipped, -a * 3.0)  # the dual-clip bound (clip_ratio_c default)
            w = min(math.exp(float(old[i][t] - rollout[i][t])), cap)
            total += w * clipped
            count += 1
    return total / count


@pytest.mark.parametrize("seed", SEEDS)
def test_decoupled_ppo_objective_matches_the_loop(make_batch, seed):
    b = make_batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    rollout = b.old_log_prob + 0.3 * torch.randn(b.shape, generator=g, dtype=torch.float64)
    adv = torch.randn(b.shape, generator=g, dtype=torch.float64)
    objective = build_actor_objective(ActorLossConfig(
        policy_loss="vanilla", clip_ratio_low=0.2, clip_ratio_high=0.28,
        correction=CorrectionSettings(is_level="token", is_threshold=1.5),
    ))
    batch = {"response_mask": b.response_mask, "advantages": adv, "old_log_probs": b.old_log_prob,
             "rollout_log_probs": rollout}
    new = b.log_prob.clone().requires_grad_(True)
    loss, metrics = objective(batch, new, None, LossContext("token-mean"))
    want = ref_decoupled_ppo(b.old_log_prob, b.log_prob, rollout, adv, b.response_mask, 0.2, 0.28, 1.5)
    assert float(loss.detach()) == pytest.approx(want, abs=1e-9)
    assert "rollout_correction/is_weight_mean" in metrics
    # the weight carries no gradient: d loss / d log pi_theta only through the PPO term
    loss.backward()
    assert torch.isfinite(new.grad).all()
    plain = build_actor_objective(ActorLossConfig(policy_loss="vanilla", clip_ratio_low=0.2, clip_ratio_high=0.28))
    assert float(plain(batch, b.log_prob, None, LossContext("token-mean"))[0]) != pytest.approx(want, abs=1e-6)


def test_correction_without_rollout_log_probs_is_explained(make_batch):
    b = make_batch(0)
    objective = build_actor_objective(ActorLossConfig(correction=CorrectionSettings(is_level="sequence")))
    batch = {"response_mask": b.response_mask, "advantages": b.token_level_rewards, "old_log_probs": b.old_log_prob}
    with pytest.raises(ValueError, match="rollout_log_probs"):
        objective(batch, b.log_prob, None, LossContext("token-mean"))


def test_extreme_ratios_stay_finite():
    old = torch.tensor([[0.0, -80.0, 80.0]], dtype=torch.float64)
    rollout = torch.tensor([[-90.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    for s in SETTINGS:
        w, _ = rollout_correction_weights(old, rollout, mask, s)
        assert torch.isfinite(w).all()
