"""KL estimators, KL-in-reward and the KL controllers against references from Schulman (2020) and Ziegler et al. (2019)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import (
    KL_TYPES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    get_kl_controller,
    kl_loss,
    kl_penalty,
)

TOL = 1e-6


def ref_kl(logp: float, ref_logp: float, kind: str) -> float:
    """Schulman 2020, "Approximating KL Divergence": with r = p_ref / p (samples from p),
    k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r (bounded to [-10, 10] here), abs = |log r|."""
    log_r = ref_logp - logp
    base = kind.rstrip("+")
    base = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}.get(base, base)
    if base == "k1":
        return -log_r
    if base == "k2":
        return 0.5 * log_r**2
    if base == "k3":
        return min(max(math.exp(log_r) - 1 - log_r, -10.0), 10.0)
    return abs(log_r)


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("seed", range(3))
def test_estimators_match_reference_values(make_batch, kl_type, seed):
    b = make_batch(seed)
    out = kl_penalty(b.log_prob, b.ref_log_prob, kl_type)
    expected = [
        [ref_kl(p, q, kl_type) for p, q in zip(row_p, row_q)]
        for row_p, row_q in zip(b.log_prob.tolist(), b.ref_log_prob.tolist())
    ]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), atol=TOL, rtol=0)


@pytest.mark.parametrize("kl_type", [t for t in KL_TYPES if t.endswith("+")])
def test_straight_through_has_the_gradient_of_k2(make_batch, kl_type):
    # d k2 / d log p = log p - log p_ref (the true gradient of KL(p || p_ref) under samples from p)
    b = make_batch(0)
    logp = b.log_prob.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(kl_penalty(logp, b.ref_log_prob, kl_type).sum(), logp)
    torch.testing.assert_close(g, b.log_prob - b.ref_log_prob, atol=TOL, rtol=0)


def test_plain_estimators_have_their_own_gradient():
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    (g1,) = torch.autograd.grad(kl_penalty(logp, ref, "k1").sum(), logp)
    (g3,) = torch.autograd.grad(kl_penalty(logp, ref, "k3").sum(), logp)
    assert g1.item() == pytest.approx(1.0)
    assert g3.item() == pytest.approx(1 - 0.5)  # d/dx [e^{-x} - 1 + x] = 1 - e^{-x}, x = ln 2


def test_kl_by_hand():
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25), math.log(0.5) + 20.0]], dtype=torch.float64)  # 2nd: p_ref >> p
    # first token: log ratio x = ln 2: k1 = ln 2, k2 = (ln 2)^2 / 2, k3 = 1/2 - 1 + ln 2
    ln2 = math.log(2)
    assert kl_penalty(logp, ref, "k1")[0, 0].item() == pytest.approx(ln2)
    assert kl_penalty(logp, ref, "mse")[0, 0].item() == pytest.approx(ln2**2 / 2)
    assert kl_penalty(logp, ref, "low_var_kl")[0, 0].item() == pytest.approx(ln2 - 0.5)
    assert kl_penalty(logp, ref, "k3")[0, 1].item() == 10.0  # e^20 - 21 clamped
    assert kl_penalty(logp, ref, "abs")[0, 1].item() == pytest.approx(20.0)


def test_unknown_kl_type_lists_known():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(x, x, "k4")


@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_apply_kl_penalty_matches_reference(make_batch, kl_type):
    b = make_batch(2)
    scores = b.token_level_rewards
    rewards, metrics = apply_kl_penalty(scores, b.log_prob, b.ref_log_prob, b.response_mask, 0.05, kl_type)
    per_seq = []
    for i in range(scores.shape[0]):
        kls = []
        for t in range(scores.shape[1]):
            if b.response_mask[i, t] > 0:
                kl = ref_kl(b.log_prob[i, t].item(), b.ref_log_prob[i, t].item(), kl_type)
                kls.append(kl)
                assert rewards[i, t].item() == pytest.approx(scores[i, t].item() - 0.05 * kl, abs=TOL)
            else:  # nothing subtracted on masked positions
                assert rewards[i, t].item() == scores[i, t].item()
        per_seq.append(sum(kls) / len(kls))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(sum(per_seq) / len(per_seq), abs=TOL)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.05


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_kl_loss_is_the_aggregated_estimator(make_batch, mode):
    b = make_batch(4)
    logp = b.log_prob.clone().requires_grad_(True)
    loss, metrics = kl_loss(logp, b.ref_log_prob, b.response_mask, "low_var_kl+", loss_agg_mode=mode)
    expected = agg_loss(kl_penalty(logp, b.ref_log_prob, "low_var_kl+"), b.response_mask, mode)
    torch.testing.assert_close(loss, expected)
    idx = b.response_mask.nonzero().tolist()
    k3 = [ref_kl(b.log_prob[i, t].item(), b.ref_log_prob[i, t].item(), "k3") for i, t in idx]
    assert metrics["kl_loss"] == pytest.approx(sum(k3) / len(k3), abs=TOL)


def test_adaptive_controller_matches_ziegler_update():
    # Ziegler et al. 2019, sec. 2.2: e_t = clip(KL_t / KL_target - 1, -0.2, 0.2); beta <- beta (1 + K_beta e_t),
    # with K_beta = n_steps / horizon.
    ctrl = get_kl_controller("adaptive", kl_coef=0.1, target_kl=0.5, horizon=1000)
    beta = 0.1
    for kl in [0.5, 0.6, 10.0, 0.0, 0.45, 0.51]:
        ctrl.update(kl, n_steps=64)
        beta *= 1 + min(max(kl / 0.5 - 1, -0.2), 0.2) * 64 / 1000
        assert ctrl.value == pytest.approx(beta, rel=1e-12)
    clone = AdaptiveKLController(1.0, 1.0, 1)
    clone.load_state_dict(ctrl.state_dict())
    clone.update(1.0, 64)
    ctrl.update(1.0, 64)
    assert clone.value == ctrl.value


def test_fixed_controller_stays_fixed_and_round_trips():
    ctrl = get_kl_controller("fixed", kl_coef=0.02)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(5.0, 100)
    assert ctrl.value == 0.02
    other = FixedKLController(0.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.02
    with pytest.raises(ValueError, match="fixed, adaptive"):
        get_kl_controller("pid")
    with pytest.raises(ValueError, match="target_kl"):
        get_kl_controller("adaptive", target_kl=0.0)
