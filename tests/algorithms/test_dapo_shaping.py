"""DAPO overlong reward shaping and the dynamic-sampling group filter against references from Yu et al. (2025)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algorithms import filter_groups, overlong_reward_penalty


def ref_overlong(length: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. 13: R_length(y)."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_overlong_penalty_matches_reference():
    lengths = torch.arange(0, 130)
    out = overlong_reward_penalty(lengths, max_response_length=128, overlong_buffer_len=32, penalty_factor=0.5)
    expected = [0.5 * ref_overlong(n, 128, 32) for n in range(130)]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)
    assert (out <= 0).all() and out.shape == (130,)


def test_overlong_penalty_by_hand_and_validation():
    out = overlong_reward_penalty(torch.tensor([10, 12, 14, 16], dtype=torch.float64), 16, 4, 1.0)
    assert out.tolist() == [0.0, 0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_reward_penalty(torch.tensor([1]), 16, 0, 1.0)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_reward_penalty(torch.tensor([1]), 16, 4, -1.0)


def ref_filter(index, metric) -> list[bool]:
    """Keep a row iff its group has more than one distinct metric value (std > 0)."""
    return [len({m for u, m in zip(index, metric) if u == uid}) > 1 for uid in index]


@pytest.mark.parametrize("seed", range(5))
def test_filter_groups_matches_reference(make_batch, seed):
    b = make_batch(seed, batch=30)
    rng = np.random.default_rng(seed)
    metric = rng.integers(0, 2, size=30).astype(float)  # 0/1 accuracies: many all-equal groups
    keep = filter_groups(b.index, torch.tensor(metric))
    assert keep.dtype == bool and keep.tolist() == ref_filter(list(b.index), metric.tolist())
    assert 0 < keep.sum() < 30


def test_filter_groups_by_hand():
    index = np.array(["a", "b", "a", "c", "b", "d", "d"])
    metric = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.5])
    # a: {1, 0} kept; b: all 0 dropped; c: size 1 dropped; d: all 0.5 dropped
    assert filter_groups(index, metric).tolist() == [True, False, True, False, False, False, False]
    with pytest.raises(ValueError, match="NaN at rows"):
        filter_groups(index, np.array([1.0, np.nan, 0, 0, 0, 0, 0]))
