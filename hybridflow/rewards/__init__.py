"""hybridflow.rewards: rule scorers chosen by data_source, custom reward functions, the reward manager, the sandbox.

The manager (which needs torch) is imported lazily: reward worker processes import this package to unpickle their
scorer, and should not pay for torch.
"""

from __future__ import annotations

from typing import Any

from hybridflow.rewards.custom import CustomRewardFunction, load_custom_reward_fn
from hybridflow.rewards.registry import (
    RewardConfigError,
    ScorerTable,
    available_scorers,
    default_compute_score,
    register_scorer,
)

__all__ = [
    "CustomRewardFunction",
    "RewardComputationError",
    "RewardConfigError",
    "RewardManager",
    "RewardResult",
    "ScorerTable",
    "available_scorers",
    "default_compute_score",
    "load_custom_reward_fn",
    "register_scorer",
]

_LAZY = {"RewardManager", "RewardResult", "RewardComputationError"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from hybridflow.rewards import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'hybridflow.rewards' has no attribute {name!r}")
