"""DAPO (Yu et al. 2025) data-side pieces: soft overlong punishment and the group filter for dynamic sampling."""

from __future__ import annotations

import numpy as np
import torch


def overlong_reward_penalty(
    response_lengths: torch.Tensor, max_response_length: int, overlong_buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """Soft overlong punishment (DAPO eq. 13) per response, [B] -> [B], all <= 0. Add it to the sequence reward.

    With L_max = max_response_length and L_cache = overlong_buffer_len:
      0                                         if |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache       inside the buffer (linear from 0 down to -1)
      -1                                        if |y| >= L_max (truncated)
    multiplied by penalty_factor.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in (0, max_response_length={max_response_length}], got {overlong_buffer_len}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0 (the penalty is subtracted), got {penalty_factor}")
    lengths = torch.as_tensor(response_lengths, dtype=torch.float64)
    start = max_response_length - overlong_buffer_len
    fraction = torch.clamp((lengths - start) / overlong_buffer_len, min=0.0, max=1.0)
    out_dtype = response_lengths.dtype if torch.is_floating_point(response_lengths) else torch.float32
    return (0.0 - penalty_factor * fraction).to(out_dtype)  # 0.0 - x: no "-0.0" in logs


def filter_groups(index: np.ndarray, seq_metric: np.ndarray | torch.Tensor) -> np.ndarray:
    """Dynamic-sampling filter: bool [B], True for rows whose group's metric values are not all identical.

    index: [B] group id (uid) per row; seq_metric: [B] the per-sequence metric (e.g. the score or accuracy). A group
    where every response scores the same gives every response advantage 0 under GRPO-style estimators, i.e. no
    gradient, so DAPO drops it and samples more prompts. Groups of size 1 are dropped too (their std is 0).
    """
    uids = np.asarray(index)
    metric = seq_metric.detach().cpu().numpy() if isinstance(seq_metric, torch.Tensor) else np.asarray(seq_metric)
    if uids.shape != metric.shape or uids.ndim != 1:
        raise ValueError(f"index and seq_metric must both be [batch]; got shapes {uids.shape} and {metric.shape}")
    metric = metric.astype(np.float64)
    if np.isnan(metric).any():
        rows = np.flatnonzero(np.isnan(metric))[:5].tolist()
        raise ValueError(f"seq_metric has NaN at rows {rows}; fix the reward function before filtering groups")
    _, groups = np.unique(uids, return_inverse=True)
    groups = groups.reshape(-1)
    num_groups = int(groups.max()) + 1 if groups.size else 0
    group_max = np.full(num_groups, -np.inf)
    group_min = np.full(num_groups, np.inf)
    np.maximum.at(group_max, groups, metric)
    np.minimum.at(group_min, groups, metric)
    return (group_max > group_min)[groups]
