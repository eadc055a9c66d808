"""Clipped value loss and explained variance against plain-loop references."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import LOSS_AGG_MODES, compute_value_loss, explained_variance

TOL = 1e-6


def ref_value_token_loss(v, v_old, ret, clip):
    """PPO value clipping (Schulman et al. 2017; OpenAI baselines ppo2): 0.5 max((v - R)^2, (v_clip - R)^2)."""
    if clip is None:
        return 0.5 * (v - ret) ** 2, False
    v_clip = v_old + min(max(v - v_old, -clip), clip)
    return 0.5 * max((v - ret) ** 2, (v_clip - ret) ** 2), (v_clip - ret) ** 2 > (v - ret) ** 2


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip", [0.2, None])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_matches_reference(make_batch, seed, clip, mode):
    b = make_batch(seed)
    vpreds, old, ret, mask = b.values, b.ref_log_prob, b.token_level_rewards, b.response_mask
    loss, metrics = compute_value_loss(vpreds, old, ret, mask, cliprange_value=clip, loss_agg_mode=mode)
    rows, clipped, n = [], 0, 0
    for i in range(mask.shape[0]):
        row = []
        for t in range(mask.shape[1]):
            if mask[i, t] > 0:
                value, was_clipped = ref_value_token_loss(vpreds[i, t].item(), old[i, t].item(), ret[i, t].item(), clip)
                row.append(value)
                clipped += was_clipped
                n += 1
        rows.append(row)
    if mode == "token-mean":
        expected = sum(map(sum, rows)) / n
    elif mode == "seq-mean-token-sum":
        expected = sum(map(sum, rows)) / len(rows)
    elif mode == "seq-mean-token-mean":
        expected = sum(sum(r) / len(r) for r in rows) / len(rows)
    else:
        expected = sum(sum(r) / mask.shape[1] for r in rows) / len(rows)
    assert loss.item() == pytest.approx(expected, abs=TOL)
    assert metrics["vf_clipfrac"] == pytest.approx(clipped / n, abs=TOL)
    if clip is not None:
        assert 0 < metrics["vf_clipfrac"] < 1


def test_value_loss_by_hand_and_clipped_gradient():
    # V_old 0, V 1, R 2, clip 0.5: V_clip = 0.5; max(1, 2.25) = 2.25 -> 1.125; the clipped branch has no gradient
    v = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = compute_value_loss(
        v, torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), 2.0, dtype=torch.float64), torch.ones(1, 1),
        cliprange_value=0.5,
    )  # fmt: skip
    assert loss.item() == pytest.approx(1.125) and metrics["vf_clipfrac"] == 1.0
    assert torch.autograd.grad(loss, v)[0].item() == 0.0


def test_explained_variance_matches_reference(make_batch):
    b = make_batch(5)
    values, returns, mask = b.values, b.token_level_rewards, b.response_mask
    idx = mask.nonzero().tolist()
    r = [returns[i, t].item() for i, t in idx]
    d = [returns[i, t].item() - values[i, t].item() for i, t in idx]

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    assert explained_variance(values, returns, mask) == pytest.approx(1 - var(d) / var(r), abs=TOL)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert math.isnan(explained_variance(values, torch.ones_like(returns), mask))  # constant returns: undefined
