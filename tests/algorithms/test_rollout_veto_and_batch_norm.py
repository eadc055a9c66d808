"""veRL's rollout_token_veto_threshold and rollout_is_batch_normalize against plain loops written from their
definitions: a sequence with one token whose ratio pi_old/pi_rollout is below the veto threshold is rejected whole; the
truncated IS weights are divided by their batch mean (over valid tokens, or over rows at sequence level)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.objective import ActorLossConfig, LossContext, build_actor_objective
from hybridflow.algorithms.off_policy import CorrectionSettings, is_weight_batch_stats, rollout_correction_weights

SEEDS = range(4)
TOL = 1e-9


def loop_weights(old, rollout, mask, s: CorrectionSettings):
    """Per row: truncated IS weight per token (or the row's product), divided by the batch mean when asked; a row
    with any token ratio < veto gets 0 everywhere; rejection outside [lo, hi] as in TIS/MIS."""
    B, T = mask.shape
    rows = []
    for i in range(B):
        valid = [t for t in range(T) if mask[i][t] > 0]
        tok = {t: math.exp(float(old[i][t] - rollout[i][t])) for t in valid}
        seq = math.exp(sum(float(old[i][t] - rollout[i][t]) for t in valid))
        rows.append((valid, tok, seq))
    mean = 1.0
    if s.batch_normalize:
        if s.is_level == "token":
            ws = [min(tok[t], s.is_threshold) for valid, tok, _ in rows for t in valid]
        else:
            ws = [min(seq, s.is_threshold) for valid, _, seq in rows if valid]
        mean = sum(ws) / len(ws)
    out = [[0.0] * T for _ in range(B)]
    vetoes = 0
    for i, (valid, tok, seq) in enumerate(rows):
        vetoed = s.veto_threshold is not None and any(tok[t] < s.veto_threshold for t in valid)
        vetoes += vetoed
        for t in valid:
            w = 1.0
            if s.is_level is not None:
                w = min(tok[t] if s.is_level == "token" else seq, s.is_threshold) / mean
            if s.rs_level is not None:
                lo, hi = s.band()
                rho = tok[t] if s.rs_level == "token" else seq
                if not lo <= rho <= hi:
                    w = 0.0
            out[i][t] = 0.0 if vetoed else w
    return torch.tensor(out, dtype=torch.float64), mean, vetoes / sum(1 for valid, _, _ in rows if valid)


def rollout_of(b, seed, spread=0.6):
    g = torch.Generator().manual_seed(100 + seed)
    return b.old_log_prob + spread * torch.randn(b.shape, generator=g, dtype=torch.float64)


SETTINGS = [
    CorrectionSettings(veto_threshold=0.5),  # veto alone: weights are 1 or 0 per row
    CorrectionSettings(is_level="token", is_threshold=1.5, veto_threshold=0.3),
    CorrectionSettings(is_level="token", is_threshold=1.5, batch_normalize=True),
    CorrectionSettings(is_level="sequence", is_threshold=2.0, batch_normalize=True),
    CorrectionSettings(is_level="sequence", is_threshold=3.0, batch_normalize=True, rs_level="token", rs_upper=2.5,
                       veto_threshold=0.2),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"is={s.is_level}-norm={s.batch_normalize}-"
                                                             f"veto={s.veto_threshold}-rs={s.rs_level}")
def test_weights_match_the_loop(make_batch, seed, settings):
    b = make_batch(seed)
    rollout = rollout_of(b, seed)
    got, metrics = rollout_correction_weights(b.old_log_prob, rollout, b.response_mask, settings)
    want, mean, veto_fraction = loop_weights(b.old_log_prob, rollout, b.response_mask, settings)
    assert torch.allclose(got, want, atol=TOL, rtol=TOL)
    if settings.veto_threshold is not None:
        assert metrics["veto_fraction"] == pytest.approx(veto_fraction)
    if settings.batch_normalize:
        assert metrics["is_batch_mean"] == pytest.approx(mean, abs=TOL)


def test_veto_fires_and_spares_rows(make_batch):
    """The check can fail: some rows are vetoed, some are not, at this spread."""
    b = make_batch(0)
    _, metrics = rollout_correction_weights(b.old_log_prob, rollout_of(b, 0), b.response_mask,
                                            CorrectionSettings(veto_threshold=0.5))
    assert 0 < metrics["veto_fraction"] < 1


def test_batch_mean_from_split_rows_is_the_whole_batch_mean(make_batch):
    """Ranks each sum their rows' weights; the summed stats give the weights of the whole batch, whatever the split."""
    b = make_batch(1)
    rollout = rollout_of(b, 1)
    for level in ("token", "sequence"):
        s = CorrectionSettings(is_level=level, is_threshold=1.5, batch_normalize=True)
        whole, _ = rollout_correction_weights(b.old_log_prob, rollout, b.response_mask, s)
        half = len(b.response_mask) // 2
        parts = [slice(0, half), slice(half, None)]
        stats = sum(is_weight_batch_stats(b.old_log_prob[p], rollout[p], b.response_mask[p], s) for p in parts)
        mean = float(stats[0] / stats[1])
        pieces = [rollout_correction_weights(b.old_log_prob[p], rollout[p], b.response_mask[p], s, mean)[0]
                  for p in parts]
        assert torch.allclose(torch.cat(pieces), whole, atol=TOL)
        valid = b.response_mask > 0
        if level == "token":
            assert float(whole[valid].mean()) == pytest.approx(1.0)


def test_objective_uses_the_batch_mean_from_the_context(make_batch):
    b = make_batch(2)
    rollout = rollout_of(b, 2, spread=0.3)
    settings = CorrectionSettings(is_level="token", is_threshold=2.0, batch_normalize=True)
    objective = build_actor_objective(ActorLossConfig(policy_loss="ppo", correction=settings))
    batch = {"response_mask": b.response_mask, "advantages": b.token_level_rewards, "old_log_probs": b.old_log_prob,
             "rollout_log_probs": rollout}
    loss_1, _ = objective(batch, b.log_prob, None, LossContext(is_batch_mean=1.0))
    loss_2, m2 = objective(batch, b.log_prob, None, LossContext(is_batch_mean=2.0))
    assert float(loss_1) == pytest.approx(2 * float(loss_2))  # the weights halve, so does the policy loss
    assert m2["rollout_correction/is_batch_mean"] == 2.0
