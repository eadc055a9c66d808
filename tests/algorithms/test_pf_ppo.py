"""PF-PPO's reward-based resampling (Zhang et al. 2024, veRL's algorithm.pf_ppo keys) against a plain loop reference."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.pf_ppo import PF_PPO_WEIGHTS, WEIGHT_FLOOR, pf_ppo_resample_indices, pf_ppo_weights


def ref_weights(scores: list[float], method: str, weight_pow: float) -> list[float]:
    """One response at a time, as the method's definition reads."""
    hi, lo = max(scores), min(scores)
    out = []
    for s in scores:
        if method == "pow":
            w = abs(s) ** weight_pow
        elif method == "max_min":
            w = 1.0 if s in (hi, lo) else 0.0
        else:  # max_random
            w = 0.4 if s == hi else 0.1
        out.append(w + WEIGHT_FLOOR)
    return out


SCORES = [0.0, 1.0, -0.5, 1.0, 0.25, -0.5, 2.0, 0.75]


@pytest.mark.parametrize("method,weight_pow", [("pow", 2.0), ("pow", 1.0), ("pow", 0.5), ("max_min", 2.0),
                                               ("max_random", 2.0)])
def test_weights_match_the_loop_reference(method, weight_pow):
    got = pf_ppo_weights(torch.tensor(SCORES), method, weight_pow)
    torch.testing.assert_close(got, torch.tensor(ref_weights(SCORES, method, weight_pow), dtype=torch.float64))
    assert (got > 0).all()


def test_resampling_draws_rows_in_proportion_to_the_weights():
    scores = torch.tensor(SCORES)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(SCORES))
    for _ in range(2000):
        idx = pf_ppo_resample_indices(scores, "pow", 2.0, gen)
        assert idx.shape == (len(SCORES),) and idx.dtype == torch.int64
        counts += torch.bincount(idx, minlength=len(SCORES))
    want = torch.tensor(ref_weights(SCORES, "pow", 2.0))
    torch.testing.assert_close(counts / counts.sum(), want / want.sum(), atol=0.01, rtol=0)
    assert counts[0] == 0  # a zero score under pow is (almost) never drawn
    # max_min: only the extremes (2.0 and the two -0.5) are drawn
    idx = pf_ppo_resample_indices(scores, "max_min", 2.0, torch.Generator().manual_seed(1))
    assert set(idx.tolist()) <= {2, 5, 6}


def test_same_seed_same_draw_and_bad_input_named():
    scores = torch.tensor(SCORES)
    a = pf_ppo_resample_indices(scores, "max_random", 2.0, torch.Generator().manual_seed(7))
    b = pf_ppo_resample_indices(scores, "max_random", 2.0, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"one score per response"):
        pf_ppo_weights(torch.zeros(2, 3), "pow", 2.0)
    with pytest.raises(ValueError, match=r"unknown PF-PPO reweight method 'powr'.*Did you mean 'pow'"):
        pf_ppo_weights(scores, "powr", 2.0)


def test_a_registered_method_is_used():
    PF_PPO_WEIGHTS.add("only_first", lambda s, p: (torch.arange(len(s)) == 0).to(s.dtype))
    try:
        idx = pf_ppo_resample_indices(torch.tensor(SCORES), "only_first", 2.0, torch.Generator().manual_seed(0))
        assert idx.tolist() == [0] * len(SCORES)
    finally:
        PF_PPO_WEIGHTS.remove("only_first")
