"""agg_loss against plain-loop references, the micro-batch split invariance, and the masked statistics."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    count_tokens_and_seqs,
    get_policy_loss,
    masked_mean,
    masked_whiten,
)

TOL = 1e-6


def ref_agg(loss, mask, mode, norm_length=None):
    """The four reductions written out over Python lists (Dr. GRPO, Liu et al. 2025, for the -norm mode)."""
    rows = [[loss[i][t] for t in range(len(mask[i])) if mask[i][t] > 0] for i in range(len(mask))]
    # a row without any valid token still counts as a sequence (it contributes 0)
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r) / len(rows)
    length = norm_length if norm_length is not None else len(mask[0])
    return sum(sum(r) / length for r in rows) / len(rows)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_reference(make_batch, seed, mode):
    b = make_batch(seed)
    loss = b.values
    mask = b.response_mask.clone()
    mask[-1] = 0  # an empty row: counts as a sequence with loss 0, must not produce NaN
    out = agg_loss(loss, mask, mode)
    assert out.shape == ()
    assert out.item() == pytest.approx(ref_agg(loss.tolist(), mask.tolist(), mode), abs=TOL)
    if mode == "seq-mean-token-sum-norm":
        out = agg_loss(loss, mask, mode, norm_length=100)
        assert out.item() == pytest.approx(ref_agg(loss.tolist(), mask.tolist(), mode, norm_length=100), abs=TOL)


def test_agg_loss_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)  # valid: (1, 2) and (4)
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((3 / 3 + 4 / 3) / 2)
    assert count_tokens_and_seqs(mask) == (3.0, 2.0)
    empty_row = torch.cat([mask, torch.zeros(1, 3, dtype=torch.float64)])
    loss3 = torch.cat([loss, torch.full((1, 3), 9.0, dtype=torch.float64)])
    assert count_tokens_and_seqs(empty_row) == (3.0, 3.0)
    assert agg_loss(loss3, empty_row, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4 + 0) / 3)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("split", [(4, 2), (2, 4), (8, 1)])
def test_gradient_does_not_depend_on_micro_batch_split(make_batch, mode, split):
    """1 x 8 vs micro-batches: sum of micro losses (with mini-batch counts) == whole loss, gradient to 1e-6."""
    b = make_batch(3, batch=8, length=9)
    num_micro, micro_size = split
    params = b.log_prob.clone().requires_grad_(True)
    global_tokens, global_seqs = count_tokens_and_seqs(b.response_mask)

    def per_token_loss(rows):  # a PPO loss so the test covers the path the actor takes
        return get_policy_loss("ppo")(
            b.old_log_prob[rows], params[rows], b.values[rows], b.response_mask[rows], loss_agg_mode=mode,
            global_num_tokens=global_tokens, global_num_seqs=global_seqs, norm_length=9,
        )[0]  # fmt: skip

    whole = per_token_loss(slice(0, 8))
    (grad_whole,) = torch.autograd.grad(whole, params)
    # The whole batch with explicit counts equals the plain local mean
    plain = get_policy_loss("ppo")(b.old_log_prob, params, b.values, b.response_mask, loss_agg_mode=mode)[0]
    torch.testing.assert_close(whole, plain, atol=TOL, rtol=0)

    micro_losses = [per_token_loss(slice(k * micro_size, (k + 1) * micro_size)) for k in range(num_micro)]
    accumulated = sum(micro_losses)
    (grad_split,) = torch.autograd.grad(accumulated, params)
    torch.testing.assert_close(accumulated, whole, atol=TOL, rtol=0)
    torch.testing.assert_close(grad_split, grad_whole, atol=TOL, rtol=0)
    # whereas a per-micro-batch token mean (local counts) would NOT be split-invariant: masks differ in length
    if mode == "token-mean" and num_micro > 1:
        chunks = [slice(k * micro_size, (k + 1) * micro_size) for k in range(num_micro)]
        naive = sum(agg_loss(b.values[c], b.response_mask[c], mode) for c in chunks) / num_micro
        assert abs(naive.item() - agg_loss(b.values, b.response_mask, mode).item()) > 1e-3


def test_unknown_mode_lists_the_known_ones():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        agg_loss(torch.zeros(1, 2), torch.ones(1, 2), "mean")


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_and_whiten_match_reference(make_batch):
    b = make_batch(1)
    x, mask = b.token_level_rewards, b.response_mask
    vals = [x[i, t].item() for i, t in mask.nonzero().tolist()]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    assert masked_mean(x, mask).item() == pytest.approx(mean, abs=TOL)
    row_means = masked_mean(x, mask, dim=-1)
    for i in range(mask.shape[0]):
        row = [x[i, t].item() for t in range(mask.shape[1]) if mask[i, t] > 0]
        assert row_means[i].item() == pytest.approx(sum(row) / len(row), abs=TOL)
    white = masked_whiten(x, mask)
    for i, t in mask.nonzero().tolist():
        assert white[i, t].item() == pytest.approx((x[i, t].item() - mean) / math.sqrt(var + 1e-8), abs=TOL)
    rescaled = masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(rescaled, white + mean)


def test_masked_statistics_ignore_nan_and_empty_masks():
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]])
    mask = torch.tensor([[True, False], [False, True]])
    assert masked_mean(x, mask).item() == 2.0
    assert torch.isfinite(masked_whiten(x, mask)[mask]).all()
    empty = torch.zeros(2, 2, dtype=torch.bool)
    assert masked_mean(x, empty).item() == 0.0
    with pytest.raises(ValueError, match="must match"):
        masked_mean(x, torch.ones(2, 3))
