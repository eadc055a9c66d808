"""Advantage estimators: token-level rewards [B, T] -> (advantages [B, T], returns [B, T]).

Every estimator takes the same arguments and ignores the ones it does not use, so the driver calls them uniformly:

    est = get_advantage_estimator(name)
    advantages, returns = est(token_level_rewards, response_mask, index=uids, values=values,
                              reward_baselines=greedy_rewards, gamma=..., lam=..., norm_adv_by_std_in_grpo=...)

Conventions shared by all of them:
- `response_mask` [B, T] is 1 on tokens the policy generated (the ones trained on), 0 on padding and on tokens it did
  not generate (e.g. tool outputs in multi-turn rollouts); outputs are exactly 0 on masked positions.
- The sequence score of a row is the sum of its token-level rewards over valid tokens (for outcome rewards that is the
  reward placed on the last token, minus any per-token KL penalty).
- `index` [B] is the group id (uid) of each row: the rollout_n responses sampled for one prompt share it. A group of
  size 1 has no baseline to compare with and gets advantage 0 (never NaN), as does a group whose scores are all equal.
- For critic-free estimators `returns` equals `advantages` (there is no value function to regress).
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.algorithms.masked import masked_whiten
from hybridflow.algorithms.registry import register_advantage


def _check_rewards_and_mask(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be [batch, response_len], got shape {tuple(token_level_rewards.shape)}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask has shape {tuple(response_mask.shape)} but token_level_rewards has "
            f"{tuple(token_level_rewards.shape)}; both must be [batch, response_len]"
        )
    return response_mask.to(token_level_rewards.dtype)


def _sequence_scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of token rewards over valid tokens -> [B]."""
    return (token_level_rewards * mask).sum(dim=-1)


def group_ids(index: np.ndarray | list | torch.Tensor | None, batch_size: int, estimator: str) -> torch.Tensor:
    """Map arbitrary uids [B] (str, int, ...) to dense group numbers 0..G-1 as a LongTensor [B]."""
    if index is None:
        raise ValueError(
            f"advantage estimator {estimator!r} compares responses within a group and needs `index` "
            f"(the uid of each row, shared by the rollout_n samples of one prompt); pass index=batch['uid']"
        )
    if isinstance(index, torch.Tensor):
        index = index.cpu().numpy()
    uids = np.asarray(index)
    if uids.shape != (batch_size,):
        raise ValueError(f"index must hold one uid per row, shape ({batch_size},), got shape {uids.shape}")
    _, inverse = np.unique(uids, return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long)


def group_mean_std(scores: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (group mean, group sample std (n - 1), group size) of scores [B]; std is 0 for groups of size 1."""
    groups = groups.to(scores.device)
    num_groups = int(groups.max().item()) + 1 if groups.numel() else 0
    sizes = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, groups, torch.ones_like(scores)
    )
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, groups, scores)
    mean = (sums / sizes)[groups]
    sq_dev = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, groups, (scores - mean) ** 2
    )
    # Sample std (Bessel-corrected), as GRPO implementations compute it; a single sample has no spread: 0.
    var = torch.where(sizes > 1, sq_dev / (sizes - 1).clamp_min(1.0), torch.zeros_like(sq_dev))
    return mean, var.sqrt()[groups], sizes[groups]


@register_advantage("gae", needs_critic=True)
def gae(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016), token-level TD(lambda), whitened over the batch.

    delta_t = r_t + gamma * V_{t'} - V_t and A_t = delta_t + gamma * lam * A_{t'}, where t' is the next VALID token
    (masked tokens are jumped over: their rewards and values never enter) and the last valid token bootstraps 0.
    returns = A + V (before whitening); advantages = A whitened over all valid tokens of the batch.
    values: [B, T] critic predictions.
    """
    mask = _check_rewards_and_mask(token_level_rewards, response_mask)
    if values is None:
        raise ValueError("advantage estimator 'gae' needs `values` [batch, response_len] from the critic")
    if values.shape != token_level_rewards.shape:
        raise ValueError(f"values has shape {tuple(values.shape)}, expected {tuple(token_level_rewards.shape)}")
    values = values.to(token_level_rewards.dtype)
    with torch.no_grad():
        batch_size, length = token_level_rewards.shape
        next_value = token_level_rewards.new_zeros(batch_size)  # V of the next valid token; 0 after the last
        running = token_level_rewards.new_zeros(batch_size)  # A of the next valid token
        advantages = torch.zeros_like(token_level_rewards)
        for t in reversed(range(length)):
            valid = mask[:, t] > 0
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            candidate = delta + gamma * lam * running
            # On a masked token keep carrying the state of the next valid token unchanged.
            running = torch.where(valid, candidate, running)
            next_value = torch.where(valid, values[:, t], next_value)
            advantages[:, t] = torch.where(valid, candidate, torch.zeros_like(candidate))
        returns = (advantages + values) * mask
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


def _group_normalized(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    *,
    divide_by_std: bool,
    epsilon: float,
    estimator: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    mask = _check_rewards_and_mask(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, mask)
        mean, std, sizes = group_mean_std(scores, group_ids(index, scores.shape[0], estimator))
        centered = scores - mean
        if divide_by_std:
            centered = centered / (std + epsilon)
        # A lone response has no group to be compared with: advantage 0 (its centered score is 0 up to rounding).
        centered = torch.where(sizes > 1, centered, torch.zeros_like(centered))
        advantages = centered.unsqueeze(-1) * mask
    return advantages, advantages.clone()


@register_advantage("grpo", needs_group_index=True)
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (score_i - mean_group) / (std_group + eps), on every token.

    std is the sample (n - 1) std of the group's scores. norm_adv_by_std_in_grpo=False skips the division (= dr_grpo).
    """
    return _group_normalized(
        token_level_rewards,
        response_mask,
        index,
        divide_by_std=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
        estimator="grpo",
    )


@register_advantage("dr_grpo", needs_group_index=True)
def dr_grpo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, index=None, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = score_i - mean_group, no std division.

    The paper's second fix, no per-response length normalisation, is in the loss: use loss_agg_mode
    "seq-mean-token-sum-norm".
    """
    return _group_normalized(
        token_level_rewards, response_mask, index, divide_by_std=False, epsilon=0.0, estimator="dr_grpo"
    )


@register_advantage("rloo", needs_group_index=True)
def rloo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, index=None, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): A_i = score_i - mean of the OTHER scores in the group; 0 for groups of size 1.

    Computed as n / (n - 1) * (score_i - mean_group), which equals the leave-one-out difference.
    """
    mask = _check_rewards_and_mask(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, mask)
        mean, _, sizes = group_mean_std(scores, group_ids(index, scores.shape[0], "rloo"))
        leave_one_out = (scores - mean) * sizes / (sizes - 1).clamp_min(1.0)
        leave_one_out = torch.where(sizes > 1, leave_one_out, torch.zeros_like(leave_one_out))
        advantages = leave_one_out.unsqueeze(-1) * mask
    return advantages, advantages.clone()


def discounted_returns_to_go(token_level_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} over valid tokens (t' the next valid token, masked tokens skipped) -> [B, T], 0 masked."""
    running = token_level_rewards.new_zeros(token_level_rewards.shape[0])
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        valid = mask[:, t] > 0
        running = torch.where(valid, token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, torch.zeros_like(running))
    return returns


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns-to-go of the token rewards, whitened over all valid tokens.

    returns = the (unwhitened) returns-to-go; advantages = their batch-whitened version.
    """
    mask = _check_rewards_and_mask(token_level_rewards, response_mask)
    with torch.no_grad():
        returns = discounted_returns_to_go(token_level_rewards, mask, gamma)
        advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_advantage("reinforce_plus_plus_baseline", needs_group_index=True)
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, index=None, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025): score_i - mean_group on every token, then whitened over all valid tokens."""
    mask = _check_rewards_and_mask(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, mask)
        mean, _, _ = group_mean_std(scores, group_ids(index, scores.shape[0], "reinforce_plus_plus_baseline"))
        centered = (scores - mean).unsqueeze(-1) * mask
        advantages = masked_whiten(centered, mask) * mask
    return advantages, advantages.clone()


@register_advantage("remax", needs_greedy_baseline=True)
def remax(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    reward_baselines: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): A_i = score_i - reward of the greedy response to the same prompt, on every token.

    reward_baselines: [B], the greedy-decoding sequence reward for each row's prompt.
    """
    mask = _check_rewards_and_mask(token_level_rewards, response_mask)
    if reward_baselines is None:
        raise ValueError(
            "advantage estimator 'remax' needs `reward_baselines` [batch]: the reward of a greedy-decoded response "
            "to each row's prompt"
        )
    if reward_baselines.shape != (token_level_rewards.shape[0],):
        raise ValueError(
            f"reward_baselines must be [batch] = ({token_level_rewards.shape[0]},), got {tuple(reward_baselines.shape)}"
        )
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, mask)
        baselines = reward_baselines.to(device=scores.device, dtype=scores.dtype)
        advantages = (scores - baselines).unsqueeze(-1) * mask
    return advantages, advantages.clone()
