"""Policy losses against plain-loop references from each paper (values, metrics and gradients; float64, <= 1e-6)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import LOSS_AGG_MODES, available_policy_losses, get_policy_loss

SEEDS = range(4)
TOL = 1e-6


# ---------------------------------------------------------------- plain references


def ref_aggregate(token_losses, mask, mode):
    """Reduce per-token losses (list of lists of torch scalars) over valid tokens, as the mode's formula says."""
    valid = [[token_losses[i][t] for t in range(len(mask[i])) if mask[i][t] > 0] for i in range(len(mask))]
    n_tokens = sum(len(v) for v in valid)
    seqs = valid  # every row counts as a sequence (rows here always have valid tokens)
    if mode == "token-mean":
        return sum(x for v in valid for x in v) / n_tokens
    if mode == "seq-mean-token-sum":
        return sum(sum(v) for v in seqs) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(v) / len(v) for v in seqs) / len(seqs)
    return sum(sum(v) / len(mask[0]) for v in seqs) / len(seqs)  # seq-mean-token-sum-norm, norm = T


def ref_ppo_token(old, new, adv, low, high, c):
    """Schulman et al. 2017 eq. 7 (as a loss), DAPO clip-higher, and dual-clip (Ye et al. 2020, eq. 5) for A < 0."""
    ratio = torch.exp(new - old)
    clip_loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
    if adv < 0:
        return torch.minimum(clip_loss, -adv * c)
    return clip_loss


def ref_gspo_sequence_losses(old, new, adv, mask, low, high):
    """Zheng et al. 2025 eq. for GSPO: s_i = (pi/pi_old)^(1/|y_i|); per-sequence loss max(-A s, -A clip(s)).

    Sequence-level (no per-token trick): the gradient of this is the paper's GSPO gradient.
    """
    losses = []
    for i in range(len(mask)):
        pos = [t for t in range(len(mask[i])) if mask[i][t] > 0]
        s = torch.exp(sum(new[i][t] - old[i][t] for t in pos) / len(pos))
        a = adv[i][pos[0]]
        losses.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - low, 1 + high)))
    return losses


def ref_cispo_token(old, new, adv, low, high):
    """MiniMax-M1 (2025) CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi."""
    weight = min(max(math.exp(float(new.detach() - old)), 1 - low), 1 + high)
    return -weight * adv * new


def token_loss_table(fn, b, **kw):
    old, new, adv, mask = b["old"], b["new"], b["adv"], b["mask"]
    return [[fn(old[i, t], new[i, t], adv[i, t], **kw) for t in range(mask.shape[1])] for i in range(mask.shape[0])]


def loss_inputs(make_batch, seed, per_sequence_advantage=False):
    b = make_batch(seed)
    adv = b.values.clone()
    new = b.log_prob.clone()
    new[0, 0] = b.old_log_prob[0, 0] + 2.0  # far off-policy tokens so clipping and dual-clip happen
    new[1, 0] = b.old_log_prob[1, 0] - 2.0
    adv[0, 0], adv[1, 0] = -1.5, 0.8
    if per_sequence_advantage:  # GRPO-style: one advantage per response on every token
        adv = adv[:, :1].expand_as(adv).clone()
    return {"old": b.old_log_prob, "new": new.requires_grad_(True), "adv": adv, "mask": b.response_mask}


def call(name, b, mode, **kw):
    return get_policy_loss(name)(b["old"], b["new"], b["adv"], b["mask"], loss_agg_mode=mode, **kw)


def grad_of(loss, b):
    (g,) = torch.autograd.grad(loss, b["new"])
    return g


def assert_close(a, b, tol=TOL):
    torch.testing.assert_close(a, b, atol=tol, rtol=0)


# ---------------------------------------------------------------- random batches vs references


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("low,high,c", [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.5, 1.5)])
def test_ppo_value_gradient_and_metrics(make_batch, seed, mode, low, high, c):
    b = loss_inputs(make_batch, seed)
    loss, metrics = call("ppo", b, mode, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    ref = ref_aggregate(token_loss_table(ref_ppo_token, b, low=low, high=high, c=c), b["mask"].tolist(), mode)
    assert_close(loss, ref)
    assert_close(grad_of(loss, b), grad_of(ref, b))

    # metrics, counted token by token from the definitions
    mask = b["mask"]
    clipped = lower = kl = 0.0
    for i, t in mask.nonzero().tolist():
        r = math.exp(float(b["new"][i, t].detach() - b["old"][i, t]))
        a = float(b["adv"][i, t])
        clip_term = -a * min(max(r, 1 - low), 1 + high)
        clipped += clip_term > -a * r
        lower += a < 0 and max(-a * r, clip_term) > -a * c
        kl += float(b["old"][i, t] - b["new"][i, t].detach())
    n = float(mask.sum())
    assert metrics["pg_clipfrac"] == pytest.approx(clipped / n, abs=TOL)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(lower / n, abs=TOL)
    assert metrics["ppo_kl"] == pytest.approx(kl / n, abs=TOL)
    assert metrics["pg_clipfrac"] > 0 and metrics["pg_clipfrac_lower"] > 0  # the batch really exercises both clips


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("low,high", [(3e-4, 4e-4), (0.05, 0.1)])
def test_gspo_value_and_gradient_equal_sequence_level_objective(make_batch, seed, low, high):
    b = loss_inputs(make_batch, seed, per_sequence_advantage=True)
    loss, metrics = call("gspo", b, "seq-mean-token-mean", clip_ratio_low=low, clip_ratio_high=high)
    seq_losses = ref_gspo_sequence_losses(b["old"], b["new"], b["adv"], b["mask"].tolist(), low, high)
    ref = sum(seq_losses) / len(seq_losses)
    assert_close(loss, ref)
    # the stop-gradient token form must give the sequence-level gradient s_i / |y_i| * grad log pi_t
    assert_close(grad_of(loss, b), grad_of(ref, b))
    assert set(metrics) >= {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}


def test_gspo_tokens_of_a_sequence_share_one_ratio_and_clip_together():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[0.3, -0.1, 0.1]], dtype=torch.float64, requires_grad=True)  # mean log-ratio 0.1
    adv = torch.ones(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, metrics = get_policy_loss("gspo")(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-math.exp(0.1), abs=TOL)  # s = e^0.1 < 1.2: unclipped on every token
    (g,) = torch.autograd.grad(loss, new)
    assert_close(g, torch.full((1, 3), -math.exp(0.1) / 3, dtype=torch.float64))
    assert metrics["pg_clipfrac"] == 0.0
    loss, metrics = get_policy_loss("gspo")(old, new, adv, mask, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    assert loss.item() == pytest.approx(-(1 + 4e-4), abs=TOL)  # every token clipped at once
    assert metrics["pg_clipfrac"] == 1.0
    assert torch.autograd.grad(loss, new)[0].abs().max() == 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_value_and_stop_gradient(make_batch, seed, mode):
    low, high = 0.2, 0.28
    b = loss_inputs(make_batch, seed)
    loss, metrics = call("cispo", b, mode, clip_ratio_low=low, clip_ratio_high=high)
    table = token_loss_table(ref_cispo_token, b, low=low, high=high)
    assert_close(loss, ref_aggregate(table, b["mask"].tolist(), mode))
    # gradient: the clipped weight is a constant, so d loss / d log pi_t = -w_t A_t * (aggregation weight of t),
    # obtained here by differentiating the reference where w_t is a Python float (no graph through it)
    grad = grad_of(loss, b)
    assert_close(grad, grad_of(ref_aggregate(table, b["mask"].tolist(), mode), b))
    # and, unlike PPO, a clipped token (row 0, token 0 has ratio e^2) still has a gradient
    assert grad[0, 0] != 0
    mask = b["mask"]
    ratios = [math.exp(float(b["new"][i, t].detach() - b["old"][i, t])) for i, t in mask.nonzero().tolist()]
    assert metrics["pg_clipfrac"] == pytest.approx(
        sum(r < 1 - low or r > 1 + high for r in ratios) / len(ratios), abs=TOL
    )
    assert metrics["pg_clipfrac_lower"] == pytest.approx(sum(r < 1 - low for r in ratios) / len(ratios), abs=TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_reinforce_matches_reference(make_batch, seed, mode):
    b = loss_inputs(make_batch, seed)
    loss, metrics = call("reinforce", b, mode)
    table = [[-b["adv"][i, t] * b["new"][i, t] for t in range(b["mask"].shape[1])] for i in range(b["mask"].shape[0])]
    ref = ref_aggregate(table, b["mask"].tolist(), mode)
    assert_close(loss, ref)
    assert_close(grad_of(loss, b), grad_of(ref, b))
    assert metrics["pg_clipfrac"] == 0.0


# ---------------------------------------------------------------- tiny hand-computed cases


def one_token(old, new, adv):
    t = lambda x: torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
    return t(old), t(new).requires_grad_(True), t(adv), t(1.0)


def test_ppo_by_hand():
    # A = +1, ratio 1.5 > 1 + 0.28: clipped to 1.28 -> loss -1.28, no gradient
    old, new, adv, mask = one_token(0.0, math.log(1.5), 1.0)
    loss, m = get_policy_loss("ppo")(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-1.28) and m["pg_clipfrac"] == 1.0 and m["pg_clipfrac_lower"] == 0.0
    assert torch.autograd.grad(loss, new)[0].item() == 0.0
    # A = -1, ratio 4: clip branch max(4, 1.2) = 4 exceeds dual-clip cap c = 3 -> loss 3, flat
    old, new, adv, mask = one_token(0.0, math.log(4.0), -1.0)
    loss, m = get_policy_loss("ppo")(old, new, adv, mask)
    assert loss.item() == pytest.approx(3.0) and m["pg_clipfrac_lower"] == 1.0
    assert m["ppo_kl"] == pytest.approx(-math.log(4.0))
    # A = -1, ratio 0.5 < 0.8: clipped to 0.8 -> loss 0.8; dual-clip not involved
    old, new, adv, mask = one_token(0.0, math.log(0.5), -1.0)
    loss, m = get_policy_loss("ppo")(old, new, adv, mask)
    assert loss.item() == pytest.approx(0.8) and m["pg_clipfrac"] == 1.0 and m["pg_clipfrac_lower"] == 0.0


def test_cispo_and_reinforce_by_hand():
    # ratio 1.5 clipped to 1.28 as a weight: loss -1.28 * 2 * log pi, gradient -1.28 * 2
    old, new, adv, mask = one_token(math.log(0.2), math.log(0.3), 2.0)
    loss, _ = get_policy_loss("cispo")(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-1.28 * 2 * math.log(0.3))
    assert torch.autograd.grad(loss, new)[0].item() == pytest.approx(-2.56)
    loss, _ = get_policy_loss("reinforce")(old, new, adv, mask)
    assert loss.item() == pytest.approx(-2 * math.log(0.3))
    assert torch.autograd.grad(loss, new)[0].item() == pytest.approx(-2.0)


@pytest.mark.parametrize("name", available_policy_losses())
def test_extreme_log_ratio_is_clamped_finite(name):
    old = torch.tensor([[-100.0, -1.0]], dtype=torch.float32)
    new = torch.tensor([[-0.5, -1.0]], dtype=torch.float32, requires_grad=True)  # log-ratio 99.5 -> clamped to 20
    adv = torch.tensor([[-1.0, 1.0]])
    loss, metrics = get_policy_loss(name)(old, new, adv, torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_global_counts_reach_the_aggregation(make_batch):
    b = loss_inputs(make_batch, 0)
    local, _ = call("ppo", b, "token-mean")
    scaled, _ = call("ppo", b, "token-mean", global_num_tokens=4 * float(b["mask"].sum()))
    assert_close(scaled, local / 4)


def test_bad_inputs_are_explained():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages=\(2, 4\)"):
        get_policy_loss("ppo")(x, x, torch.zeros(2, 4), x)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("ppo")(x, x, x, torch.ones(2, 3), clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        get_policy_loss("ppo")(x, x, x, torch.ones(2, 3), loss_agg_mode="sum")
