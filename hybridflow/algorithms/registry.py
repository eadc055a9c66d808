"""Name -> function registries for advantage estimators and policy losses.

The driver picks an algorithm by the name in its config (``algorithm.adv_estimator: grpo``) and never branches on it.
Each registered function is wrapped in a small dataclass that is itself callable and carries the facts the driver needs
to plan the dataflow, e.g. whether a critic or a greedy-decoding baseline must be computed before advantages:

    est = get_advantage_estimator("gae")
    est.needs_critic            # True  -> the driver runs the critic to get `values`
    est.needs_greedy_baseline   # False -> (True only for "remax": the driver generates a greedy response per prompt)
    est.needs_group_index       # False -> (True for grpo/rloo/...: the driver passes `index`, the uid of each row)
    advantages, returns = est(token_level_rewards, response_mask, values=values, gamma=1.0, lam=0.95)

Adding an algorithm is one decorated function in any module imported before lookup:

    @register_advantage("my_estimator", needs_group_index=True)
    def my_estimator(token_level_rewards, response_mask, *, index=None, **_): ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A dict of named entries that refuses duplicates and explains unknown names."""

    def __init__(self, kind: str, register_hint: str):
        self.kind = kind  # e.g. "advantage estimator"; used in error messages
        self.register_hint = register_hint  # e.g. "@register_advantage"
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(
                f"{self.kind} {name!r} is already registered ({self._entries[name]!r}); "
                f"pick another name for the new one"
            )
        self._entries[name] = entry

    def remove(self, name: str) -> T:
        """Unregister `name` and return its entry (for tests and notebooks that register throw-away entries)."""
        self.get(name)  # raises the helpful error for unknown names
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names()) or "(none)"
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {known}. "
                f"Fix the name in your config, or register a new one with {self.register_hint}({name!r})"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered advantage estimator: call it like the wrapped function.

    fn(token_level_rewards [B, T], response_mask [B, T], *, index, values, reward_baselines, gamma, lam,
       norm_adv_by_std_in_grpo, epsilon, **_) -> (advantages [B, T], returns [B, T]), zero on masked positions.
    """

    name: str
    fn: Callable[..., Any]
    needs_critic: bool = False  # needs `values` [B, T] from a critic
    needs_greedy_baseline: bool = False  # needs `reward_baselines` [B]: reward of the greedy response to the prompt
    needs_group_index: bool = False  # needs `index` [B]: the group (uid) of each row, rollout_n rows per prompt
    description: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: call it like the wrapped function.

    fn(old_log_prob [B, T], log_prob [B, T], advantages [B, T], response_mask [B, T], *, loss_agg_mode,
       clip_ratio_low, clip_ratio_high, clip_ratio_c, global_num_tokens, global_num_seqs, norm_length, **_)
       -> (loss [], metrics {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", ...: float})

    `recommended` holds the settings the method's paper uses where they differ from PPO's (e.g. GSPO's tiny clip
    ranges); the driver or config layer may apply them, the loss itself never overrides what it is given.
    """

    name: str
    fn: Callable[..., Any]
    recommended: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    description: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "@register_advantage")
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "@register_policy_loss")


def register_advantage(
    name: str,
    *,
    needs_critic: bool = False,
    needs_greedy_baseline: bool = False,
    needs_group_index: bool = False,
) -> Callable[[Callable[..., Any]], AdvantageEstimator]:
    """Decorator: register `fn` as the advantage estimator `name` (see `AdvantageEstimator` for the signature)."""

    def wrap(fn: Callable[..., Any]) -> AdvantageEstimator:
        doc = (fn.__doc__ or "").strip().splitlines()
        entry = AdvantageEstimator(
            name=name,
            fn=fn,
            needs_critic=needs_critic,
            needs_greedy_baseline=needs_greedy_baseline,
            needs_group_index=needs_group_index,
            description=doc[0] if doc else "",
        )
        ADVANTAGE_ESTIMATORS.add(name, entry)
        return entry

    return wrap


def register_policy_loss(
    name: str, *, recommended: Mapping[str, Any] | None = None
) -> Callable[[Callable[..., Any]], PolicyLoss]:
    """Decorator: register `fn` as the policy loss `name` (see `PolicyLoss` for the signature)."""

    def wrap(fn: Callable[..., Any]) -> PolicyLoss:
        doc = (fn.__doc__ or "").strip().splitlines()
        entry = PolicyLoss(
            name=name,
            fn=fn,
            recommended=MappingProxyType(dict(recommended or {})),
            description=doc[0] if doc else "",
        )
        POLICY_LOSSES.add(name, entry)
        return entry

    return wrap


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; ValueError listing the known names otherwise."""
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`; ValueError listing the known names otherwise."""
    return POLICY_LOSSES.get(name)


def available_advantage_estimators() -> list[str]:
    """Sorted names of the registered advantage estimators."""
    return ADVANTAGE_ESTIMATORS.names()


def available_policy_losses() -> list[str]:
    """Sorted names of the registered policy losses."""
    return POLICY_LOSSES.names()
