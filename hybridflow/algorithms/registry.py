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

or, without touching hybridflow, name it in the config by import path (``algorithm.adv_estimator=my_pkg.adv:my_estimator``);
every process that looks the name up imports it (see hybridflow/plugins.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hybridflow.plugins import PluginError, Registry


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class PolicyLossSettings:
    """The settings a policy loss may read (PPO's names; a loss ignores those it does not use)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss.

    fn(old_log_prob [B, T], log_prob [B, T], advantages [B, T], response_mask [B, T], settings: PolicyLossSettings)
       -> (per-token loss [B, T], metrics {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", ...: float})

    The loss returns the per-token matrix; reducing it (aggregation mode, global counts) is the caller's
    (algorithms/objective.py's LossContext), the same for every loss. Calling the entry directly does both, for
    tests and notebooks: ``loss, metrics = get_policy_loss("ppo")(old, new, adv, mask, loss_agg_mode=..., ...)``;
    there, settings not given default to `recommended` (the method paper's values where they differ from PPO's,
    e.g. GSPO's tiny clip ranges), then to PPO's.
    """

    name: str
    fn: Callable[..., Any]
    recommended: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def per_token(self, old_log_prob, log_prob, advantages, response_mask, settings: PolicyLossSettings):
        _check_inputs(old_log_prob, log_prob, advantages, response_mask)
        return self.fn(old_log_prob, log_prob, advantages, response_mask, settings)

    def __call__(self, old_log_prob, log_prob, advantages, response_mask, **kwargs: Any) -> Any:
        from hybridflow.algorithms.aggregation import agg_loss

        opts = {**self.recommended, **kwargs}
        settings = PolicyLossSettings(
            **{k: opts.pop(k) for k in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c") if k in opts}
        )
        mode = opts.pop("loss_agg_mode", "token-mean")
        unknown = set(opts) - {"global_num_tokens", "global_num_seqs", "norm_length"}
        if unknown:
            raise TypeError(f"policy loss {self.name!r} got unknown arguments {sorted(unknown)}")
        mask = response_mask.to(log_prob.dtype)
        per_token, metrics = self.per_token(old_log_prob, log_prob, advantages, mask, settings)
        return agg_loss(per_token, mask, mode, **opts), metrics


def _check_inputs(old_log_prob, log_prob, advantages, response_mask) -> None:
    shapes = {
        "old_log_prob": old_log_prob.shape,
        "log_prob": log_prob.shape,
        "advantages": advantages.shape,
        "response_mask": response_mask.shape,
    }
    if len(set(shapes.values())) != 1 or log_prob.dim() != 2:
        described = ", ".join(f"{k}={tuple(v)}" for k, v in shapes.items())
        raise ValueError(f"policy loss inputs must all be [batch, response_len]; got {described}")


def _as_estimator(name: str, obj: Any) -> AdvantageEstimator:
    """What an import path names: a registered AdvantageEstimator, or a plain function (metadata from attributes)."""
    if isinstance(obj, AdvantageEstimator):
        return obj
    if not callable(obj):
        raise PluginError(f"advantage estimator {name!r} names {obj!r}, which is not a function")
    return AdvantageEstimator(
        name=name,
        fn=obj,
        needs_critic=bool(getattr(obj, "needs_critic", False)),
        needs_greedy_baseline=bool(getattr(obj, "needs_greedy_baseline", False)),
        needs_group_index=bool(getattr(obj, "needs_group_index", False)),
    )


def _as_policy_loss(name: str, obj: Any) -> PolicyLoss:
    if isinstance(obj, PolicyLoss):
        return obj
    if not callable(obj):
        raise PluginError(f"policy loss {name!r} names {obj!r}, which is not a function")
    return PolicyLoss(name=name, fn=obj)


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", "@register_advantage", coerce=_as_estimator
)
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "@register_policy_loss", coerce=_as_policy_loss)


def register_advantage(
    name: str,
    *,
    override: bool = False,
    needs_critic: bool = False,
    needs_greedy_baseline: bool = False,
    needs_group_index: bool = False,
) -> Callable[[Callable[..., Any]], AdvantageEstimator]:
    """Decorator: register `fn` as the advantage estimator `name` (see `AdvantageEstimator` for the signature)."""

    def wrap(fn: Callable[..., Any]) -> AdvantageEstimator:
        entry = AdvantageEstimator(
            name=name,
            fn=fn,
            needs_critic=needs_critic,
            needs_greedy_baseline=needs_greedy_baseline,
            needs_group_index=needs_group_index,
        )
        ADVANTAGE_ESTIMATORS.add(name, entry, override=override)
        return entry

    return wrap


def register_policy_loss(
    name: str, *, recommended: Mapping[str, Any] | None = None, override: bool = False
) -> Callable[[Callable[..., Any]], PolicyLoss]:
    """Decorator: register `fn` as the policy loss `name` (see `PolicyLoss` for the signature)."""

    def wrap(fn: Callable[..., Any]) -> PolicyLoss:
        entry = PolicyLoss(name=name, fn=fn, recommended=MappingProxyType(dict(recommended or {})))
        POLICY_LOSSES.add(name, entry, override=override)
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
