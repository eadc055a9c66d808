"""Advantage estimators against plain-loop references written from each paper's formula (float64, <= 1e-6)."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from hybridflow.algorithms import available_advantage_estimators, get_advantage_estimator

SEEDS = range(6)
TOL = 1e-6


# ---------------------------------------------------------------- plain references (lists and floats only)


def valid_positions(mask_row) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m > 0]


def seq_scores(rewards, mask) -> list[float]:
    return [sum(float(rewards[i][t]) for t in valid_positions(mask[i])) for i in range(len(mask))]


def whiten_valid(x, mask) -> list[list[float]]:
    """Whiten over all valid entries (population variance, eps 1e-8 inside the sqrt); masked -> 0."""
    vals = [x[i][t] for i in range(len(mask)) for t in valid_positions(mask[i])]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    return [
        [(x[i][t] - mean) / math.sqrt(var + 1e-8) if mask[i][t] > 0 else 0.0 for t in range(len(mask[i]))]
        for i in range(len(mask))
    ]


def broadcast(per_row, mask) -> list[list[float]]:
    return [[per_row[i] if m > 0 else 0.0 for m in mask[i]] for i in range(len(mask))]


def groups_of(index) -> dict:
    groups = defaultdict(list)
    for i, uid in enumerate(index):
        groups[uid].append(i)
    return groups


def ref_gae(rewards, values, mask, gamma, lam):
    """Schulman et al. 2016, eq. 16, over the valid tokens only: A_t = sum_l (gamma lam)^l delta_{t+l}."""
    adv = [[0.0] * len(row) for row in mask]
    ret = [[0.0] * len(row) for row in mask]
    for i in range(len(mask)):
        pos = valid_positions(mask[i])
        deltas = []
        for k, t in enumerate(pos):
            v_next = float(values[i][pos[k + 1]]) if k + 1 < len(pos) else 0.0
            deltas.append(float(rewards[i][t]) + gamma * v_next - float(values[i][t]))
        for k, t in enumerate(pos):  # the explicit sum, not the recursion the implementation uses
            adv[i][t] = sum((gamma * lam) ** j * deltas[k + j] for j in range(len(pos) - k))
            ret[i][t] = adv[i][t] + float(values[i][t])
    return whiten_valid(adv, mask), ret


def ref_grpo(rewards, mask, index, eps, divide_by_std=True):
    """Shao et al. 2024 (DeepSeekMath) outcome supervision: (r_i - mean(r)) / std(r), sample std."""
    scores = seq_scores(rewards, mask)
    adv = [0.0] * len(scores)
    for rows in groups_of(index).values():
        if len(rows) == 1:
            continue
        group = [scores[r] for r in rows]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        for r in rows:
            adv[r] = (scores[r] - mean) / (std + eps) if divide_by_std else scores[r] - mean
    return broadcast(adv, mask)


def ref_rloo(rewards, mask, index):
    """Ahmadian et al. 2024: r_i - 1/(k-1) sum_{j != i} r_j."""
    scores = seq_scores(rewards, mask)
    adv = [0.0] * len(scores)
    for rows in groups_of(index).values():
        if len(rows) == 1:
            continue
        for r in rows:
            others = [scores[o] for o in rows if o != r]
            adv[r] = scores[r] - sum(others) / len(others)
    return broadcast(adv, mask)


def ref_reinforce_pp(rewards, mask, gamma):
    """Hu 2025: G_t = sum_{s >= t} gamma^(s - t) r_s over valid tokens, whitened over the batch."""
    ret = [[0.0] * len(row) for row in mask]
    for i in range(len(mask)):
        pos = valid_positions(mask[i])
        for k, t in enumerate(pos):
            ret[i][t] = sum(gamma**j * float(rewards[i][pos[k + j]]) for j in range(len(pos) - k))
    return whiten_valid(ret, mask), ret


def ref_reinforce_pp_baseline(rewards, mask, index):
    """Hu 2025, REINFORCE++-baseline: r_i - group mean on each token, then batch whitening."""
    scores = seq_scores(rewards, mask)
    centered = [0.0] * len(scores)
    for rows in groups_of(index).values():
        mean = sum(scores[r] for r in rows) / len(rows)
        for r in rows:
            centered[r] = scores[r] - mean
    return whiten_valid(broadcast(centered, mask), mask)


def ref_remax(rewards, mask, baselines):
    """Li et al. 2023: r(x, y) - r(x, y_greedy)."""
    scores = seq_scores(rewards, mask)
    return broadcast([scores[i] - float(baselines[i]) for i in range(len(scores))], mask)


def as_lists(t: torch.Tensor):
    return t.tolist()


def assert_close(actual: torch.Tensor, expected, tol=TOL):
    expected_t = torch.tensor(expected, dtype=torch.float64)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected_t, atol=tol, rtol=0)


# ---------------------------------------------------------------- random batches vs references


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.3)])
def test_gae_matches_reference(make_batch, seed, gamma, lam):
    b = make_batch(seed)
    adv, ret = get_advantage_estimator("gae")(
        b.token_level_rewards, b.response_mask, values=b.values, gamma=gamma, lam=lam
    )
    ref_adv, ref_ret = ref_gae(
        as_lists(b.token_level_rewards), as_lists(b.values), as_lists(b.response_mask), gamma, lam
    )
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("outcome_only", [False, True])
def test_group_estimators_match_references(make_batch, seed, outcome_only):
    b = make_batch(seed, outcome_only=outcome_only)
    r, m, idx = as_lists(b.token_level_rewards), as_lists(b.response_mask), list(b.index)
    expected = {
        "grpo": ref_grpo(r, m, idx, eps=1e-6),
        "dr_grpo": ref_grpo(r, m, idx, eps=0.0, divide_by_std=False),
        "rloo": ref_rloo(r, m, idx),
        "reinforce_plus_plus_baseline": ref_reinforce_pp_baseline(r, m, idx),
    }
    for name, ref in expected.items():
        adv, ret = get_advantage_estimator(name)(b.token_level_rewards, b.response_mask, index=b.index)
        assert_close(adv, ref)
        torch.testing.assert_close(ret, adv)  # critic-free: returns are the advantages


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_without_std_normalisation_is_dr_grpo(make_batch, seed):
    b = make_batch(seed)
    grpo_no_std, _ = get_advantage_estimator("grpo")(
        b.token_level_rewards, b.response_mask, index=b.index, norm_adv_by_std_in_grpo=False
    )
    assert_close(
        grpo_no_std, ref_grpo(as_lists(b.token_level_rewards), as_lists(b.response_mask), list(b.index), 0.0, False)
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(make_batch, seed, gamma):
    b = make_batch(seed)
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(b.token_level_rewards, b.response_mask, gamma=gamma)
    ref_adv, ref_ret = ref_reinforce_pp(as_lists(b.token_level_rewards), as_lists(b.response_mask), gamma)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_remax_matches_reference(make_batch, seed):
    b = make_batch(seed)
    adv, ret = get_advantage_estimator("remax")(
        b.token_level_rewards, b.response_mask, reward_baselines=b.reward_baselines
    )
    assert_close(
        adv, ref_remax(as_lists(b.token_level_rewards), as_lists(b.response_mask), b.reward_baselines.tolist())
    )
    torch.testing.assert_close(ret, adv)


# ---------------------------------------------------------------- tiny hand-computed cases


def test_gae_by_hand_skips_masked_token():
    # mask [1, 0, 1]: the middle token's reward 5 and value 9 must not enter. gamma 0.9, lam 0.8.
    # t=2: delta = 1 + 0 - 0.25 = 0.75 = A_2.  t=0: delta = 0 + 0.9 * 0.25 - 0.5 = -0.275; A_0 = -0.275 + 0.72 * 0.75
    # = 0.265. returns = A + V = [0.765, 0, 1.0]. Whitened: two values -> -1 and +1 (up to the 1e-8 eps).
    rewards = torch.tensor([[0.0, 5.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 9.0, 0.25]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    adv, ret = get_advantage_estimator("gae")(rewards, mask, values=values, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret, torch.tensor([[0.765, 0.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0]], dtype=torch.float64), atol=1e-6, rtol=0)


def test_group_estimators_by_hand():
    # one group of 3 with outcome rewards 1, 0, 0 (on the last token) and one lone response
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [3.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    index = np.array(["a", "a", "a", "b"])
    # mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    grpo, _ = get_advantage_estimator("grpo")(rewards, mask, index=index, epsilon=0.0)
    expected = [[2 / 3 / std] * 2, [-1 / 3 / std] * 2, [-1 / 3 / std] * 2, [0.0, 0.0]]
    assert_close(grpo, expected)
    dr, _ = get_advantage_estimator("dr_grpo")(rewards, mask, index=index)
    assert_close(dr, [[2 / 3] * 2, [-1 / 3] * 2, [-1 / 3] * 2, [0.0, 0.0]])
    rloo, _ = get_advantage_estimator("rloo")(rewards, mask, index=index)  # 1 - 0, 0 - 1/2, 0 - 1/2
    assert_close(rloo, [[1.0] * 2, [-0.5] * 2, [-0.5] * 2, [0.0, 0.0]])
    remax, _ = get_advantage_estimator("remax")(
        rewards, mask, reward_baselines=torch.tensor([0.5, 0.5, 0.0, 1.0], dtype=torch.float64)
    )
    assert_close(remax, [[0.5] * 2, [-0.5] * 2, [0.0] * 2, [2.0, 0.0]])


def test_reinforce_plus_plus_by_hand():
    # returns-to-go with gamma 0.5 of [1, 2] -> [1 + 0.5 * 2, 2] = [2, 2] on row 0; row 1 [4] -> 4.
    rewards = torch.tensor([[1.0, 2.0], [4.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(rewards, mask, gamma=0.5)
    assert_close(ret, [[2.0, 2.0], [4.0, 0.0]])
    # valid values 2, 2, 4: mean 8/3, population std sqrt(8/9)
    s = math.sqrt(8 / 9 + 1e-8)
    assert_close(adv, [[(2 - 8 / 3) / s, (2 - 8 / 3) / s], [(4 - 8 / 3) / s, 0.0]])


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_size_one_groups_and_equal_rewards_give_zero_not_nan(name):
    est = get_advantage_estimator(name)
    rewards = torch.tensor([[0.0, 0.7], [0.0, 0.7], [0.3, 0.4], [1.0, 0.0]], dtype=torch.float64)
    mask = torch.ones_like(rewards)
    # every group has equal scores (0.7) or a single member
    adv, ret = est(rewards, mask, index=np.array([0, 0, 0, 1]))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    torch.testing.assert_close(adv, torch.zeros_like(adv), atol=1e-6, rtol=0)
    lone, _ = est(rewards, mask, index=np.arange(4))  # all groups of size 1
    assert torch.isfinite(lone).all()
    torch.testing.assert_close(lone, torch.zeros_like(lone), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus"])
def test_batch_whitened_estimators_constant_input_no_nan(name):
    rewards = torch.zeros(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)  # incl. an empty row
    adv, ret = get_advantage_estimator(name)(rewards, mask, values=torch.zeros_like(rewards), index=np.arange(3))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv.abs().max() == 0


@pytest.mark.parametrize("name", available_advantage_estimators())
def test_every_estimator_zero_on_masked_positions_and_dtype_kept(make_batch, name):
    b = make_batch(0)
    f32 = {k: getattr(b, k).float() for k in ("token_level_rewards", "response_mask", "values", "reward_baselines")}
    adv, ret = get_advantage_estimator(name)(
        f32["token_level_rewards"], f32["response_mask"] > 0, index=b.index, values=f32["values"],
        reward_baselines=f32["reward_baselines"],
    )  # fmt: skip
    assert adv.dtype == torch.float32 and adv.shape == b.shape
    assert (adv[b.response_mask == 0] == 0).all() and (ret[b.response_mask == 0] == 0).all()
    assert not adv.requires_grad


def test_metadata_tells_the_driver_what_to_compute():
    flags = {
        n: (e.needs_critic, e.needs_greedy_baseline, e.needs_group_index)
        for n in available_advantage_estimators()
        for e in [get_advantage_estimator(n)]
    }
    assert flags["gae"] == (True, False, False)
    assert flags["remax"] == (False, True, False)
    assert flags["reinforce_plus_plus"] == (False, False, False)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"):
        assert flags[name] == (False, False, True)


def test_missing_inputs_say_what_to_pass():
    rewards = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs `index`"):
        get_advantage_estimator("grpo")(rewards, mask)
    with pytest.raises(ValueError, match="needs `values`"):
        get_advantage_estimator("gae")(rewards, mask)
    with pytest.raises(ValueError, match="reward_baselines"):
        get_advantage_estimator("remax")(rewards, mask)
    with pytest.raises(ValueError, match="one uid per row"):
        get_advantage_estimator("rloo")(rewards, mask, index=np.arange(3))
    with pytest.raises(ValueError, match="response_mask has shape"):
        get_advantage_estimator("grpo")(rewards, torch.ones(2, 4), index=np.arange(2))
