"""hybridflow.rewards: rule scorers chosen by data_source, custom reward functions, the reward managers (by veRL's
names: naive, batch, dapo, prime), the sandbox.

The managers (which need torch) are imported lazily: reward worker processes import this package to unpickle their
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
    "BatchRewardManager",
    "CustomRewardFunction",
    "OverlongShaping",
    "PrimeRewardManager",
    "RewardComputationError",
    "RewardConfigError",
    "RewardManager",
    "RewardManagerSpec",
    "RewardResult",
    "ScorerTable",
    "available_reward_managers",
    "available_scorers",
    "build_reward_manager",
    "check_reward_manager_config",
    "default_compute_score",
    "load_custom_reward_fn",
    "register_reward_manager",
    "register_scorer",
]

_LAZY = {
    "RewardManager": "manager", "RewardResult": "manager", "RewardComputationError": "manager",
    "OverlongShaping": "manager", "BatchRewardManager": "managers", "PrimeRewardManager": "managers",
    "RewardManagerSpec": "managers", "available_reward_managers": "managers", "build_reward_manager": "managers",
    "check_reward_manager_config": "managers", "register_reward_manager": "managers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"hybridflow.rewards.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'hybridflow.rewards' has no attribute {name!r}")
