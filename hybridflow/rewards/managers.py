"""Reward managers by veRL's name (``reward_model.reward_manager``): naive | batch | dapo | prime.

What each one does, as in veRL (``verl/workers/reward_manager/*.py``):

``naive``  one call per response, ``fn(data_source, solution_str, ground_truth, extra_info)``; takes no
           ``reward_model.reward_kwargs``.
``batch``  one call per batch, ``fn(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)`` returning one
           number or dict per row; needs ``custom_reward_function.path``. ``reward_model.reward_kwargs`` are passed to
           the function (and ``custom_reward_function.reward_kwargs`` over them). Each row's score is also its ``acc``.
``dapo``   naive plus DAPO's soft overlong penalty from ``reward_model.reward_kwargs.overlong_buffer_cfg``
           (``enable``, ``len``, ``penalty_factor``, ``log``) and ``reward_model.reward_kwargs.max_resp_len``; records
           ``acc`` (the scorer's own ``acc`` when it returns a dict, else its score) and drops a trailing eos text.
``prime``  naive, but a tuple/list result counts by its first element and each score is recorded as ``acc``.

Every manager keeps the base RewardManager's worker processes, per-sample timeout and failure counting (veRL's
prime scores a failed row 0 silently; here it gets ``failure_score`` and counts). The batch call runs in one worker
with ``batch_timeout_s`` for the whole call; if it fails, every row of the batch fails with it.

Add your own: ``register_reward_manager("mine", factory)`` with ``factory(tokenizer, spec) -> RewardManager``, or
name it in the config as ``reward_model.reward_manager=my_pkg.module:factory`` (a ``hybridflow.plugins.Registry``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.plugins import Registry
from hybridflow.rewards.custom import load_custom_reward_fn
from hybridflow.rewards.manager import OverlongShaping, RewardManager
from hybridflow.rewards.pool import Outcome, check_batch_values, check_first_value, score_one
from hybridflow.rewards.registry import RewardConfigError

__all__ = [
    "REWARD_MANAGERS",
    "BatchRewardManager",
    "PrimeRewardManager",
    "RewardManagerSpec",
    "available_reward_managers",
    "build_reward_manager",
    "check_reward_manager_config",
    "load_user_function",
    "register_reward_manager",
]


@dataclass
class RewardManagerSpec:
    """What a reward-manager factory is built from (the config's reward keys, as plain values)."""

    custom_path: str | None = None  # custom_reward_function.path
    custom_name: str = "compute_score"
    custom_kwargs: dict[str, Any] = field(default_factory=dict)  # custom_reward_function.reward_kwargs
    custom_fn: Any = None  # the user's function already loaded (e.g. sandboxed); used instead of loading the path
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # reward_model.reward_kwargs (veRL: to the manager)
    max_response_length: int = 512  # data.max_response_length: DAPO's max_resp_len when not given
    legacy_overlong: OverlongShaping | None = None  # hybridflow's reward_model.overlong_buffer, any manager
    batch_timeout_s: float = 300.0
    options: dict[str, Any] = field(default_factory=dict)  # RewardManager keyword arguments (workers, timeouts, ...)


class BatchRewardManager(RewardManager):
    """veRL's ``batch`` manager: the user's function scores the whole batch in one call (see the module docstring)."""

    check = staticmethod(check_batch_values)

    def _score(self, tasks: list[dict[str, Any]]) -> list[Outcome]:
        call = {
            "data_sources": [t["data_source"] for t in tasks],
            "solution_strs": [t["solution_str"] for t in tasks],
            "ground_truths": [t["ground_truth"] for t in tasks],
            "extra_infos": [t["extra_info"] for t in tasks],
        }
        if self._pool is not None:
            (out,) = self._pool.score([call])
        else:
            out = score_one(self.compute_score, call, self.check)
        if out.kind != "ok":
            return [Outcome(out.kind, message=f"the batch call ({len(tasks)} rows): {out.message}") for _ in tasks]
        return out.extras["rows"]


class PrimeRewardManager(RewardManager):
    """veRL's ``prime`` manager: per-sample scores where ``(score, ...)`` counts by its first element."""

    check = staticmethod(check_first_value)


Factory = Callable[[Any, RewardManagerSpec], RewardManager]


@dataclass(frozen=True)
class ManagerEntry:
    """A registered manager: its factory and the ``reward_model.reward_kwargs`` keys it understands (None: any)."""

    factory: Factory
    reward_kwargs: tuple[str, ...] | None = ()


def _as_entry(name: str, obj: Any) -> ManagerEntry:
    """An import-path plugin ('pkg.mod:factory') is a factory(tokenizer, spec); it gets every reward_kwarg in spec."""
    if isinstance(obj, ManagerEntry):
        return obj
    if not callable(obj):
        raise RewardConfigError(f"reward manager {name!r} is a {type(obj).__name__}, not a factory(tokenizer, spec)")
    return ManagerEntry(obj, None)


REWARD_MANAGERS: Registry[ManagerEntry] = Registry(
    "reward manager", "hybridflow.rewards.register_reward_manager(name, factory)", coerce=_as_entry
)


def register_reward_manager(
    name: str, factory: Factory, *, reward_kwargs: tuple[str, ...] | None = (), override: bool = False
) -> None:
    """Make ``reward_model.reward_manager=name`` build ``factory(tokenizer, spec)``; `reward_kwargs` names the
    ``reward_model.reward_kwargs`` keys it understands (None: any)."""
    REWARD_MANAGERS.add(name, ManagerEntry(factory, reward_kwargs), override=override)


def available_reward_managers() -> list[str]:
    return REWARD_MANAGERS.names()


def check_reward_manager_config(name: str, reward_kwargs: dict[str, Any], custom_path: str | None,
                                custom_kwargs: dict[str, Any]) -> list[str]:
    """Problems with the reward keys, one line each (empty: fine). Run at config validation, before any worker."""
    problem = REWARD_MANAGERS.check(name)
    if problem is not None:
        return [f"reward_model.reward_manager={name!r}: {problem}"]
    errors = []
    accepted = REWARD_MANAGERS.get(name).reward_kwargs
    if accepted is not None:
        unknown = sorted(set(reward_kwargs) - set(accepted))
        if unknown:
            takes = f"takes only {list(accepted)}" if accepted else "takes none"
            errors.append(
                f"reward_model.reward_kwargs {unknown}: the {name!r} reward manager {takes}"
                + ("; the DAPO overlong buffer needs reward_model.reward_manager=dapo" if "overlong_buffer_cfg"
                   in unknown else "")
            )
    if name == "dapo":
        cfg = reward_kwargs.get("overlong_buffer_cfg") or {}
        if not isinstance(cfg, dict):
            errors.append(f"reward_model.reward_kwargs.overlong_buffer_cfg must be a mapping, got {cfg!r}")
        elif set(cfg) - {"enable", "len", "penalty_factor", "log"}:
            errors.append(
                f"reward_model.reward_kwargs.overlong_buffer_cfg.{sorted(set(cfg) - {'enable', 'len', 'penalty_factor', 'log'})}"
                ": unknown; the keys are enable, len, penalty_factor, log"
            )
    if name == "batch" and not custom_path:
        errors.append(
            "reward_model.reward_manager=batch calls your function once per batch: set custom_reward_function.path "
            "(and .name) to fn(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list"
        )
    if custom_kwargs and not custom_path:
        errors.append(
            "custom_reward_function.reward_kwargs is set but custom_reward_function.path is not; the built-in "
            "scorers take no kwargs - set the path or drop the kwargs"
        )
    return errors


def build_reward_manager(name: str, tokenizer: Any, spec: RewardManagerSpec) -> RewardManager:
    """The reward manager registered as `name`, built from `spec`; RewardConfigError names what to change."""
    errors = check_reward_manager_config(name, spec.reward_kwargs, spec.custom_path, spec.custom_kwargs)
    if errors:
        raise RewardConfigError("; ".join(errors))
    return REWARD_MANAGERS.get(name).factory(tokenizer, spec)


def load_user_function(name: str, spec: RewardManagerSpec) -> Any:
    """The user's function (custom_reward_function) as manager `name` calls it; None without a path."""
    batch = name == "batch"
    return _custom(spec, batch=batch, extra_kwargs=spec.reward_kwargs if batch else None)


def _custom(spec: RewardManagerSpec, *, batch: bool = False, extra_kwargs: dict[str, Any] | None = None):
    if spec.custom_fn is not None:
        return spec.custom_fn
    if not spec.custom_path:
        return None
    kwargs = {**(extra_kwargs or {}), **spec.custom_kwargs}  # veRL: the custom function's own kwargs win
    return load_custom_reward_fn(f"{spec.custom_path}:{spec.custom_name}", kwargs=kwargs, batch=batch)


def _naive(tokenizer: Any, spec: RewardManagerSpec) -> RewardManager:
    return RewardManager(tokenizer, _custom(spec), overlong=spec.legacy_overlong, **spec.options)


def _prime(tokenizer: Any, spec: RewardManagerSpec) -> RewardManager:
    return PrimeRewardManager(tokenizer, _custom(spec), overlong=spec.legacy_overlong, record_acc=True, **spec.options)


def _batch(tokenizer: Any, spec: RewardManagerSpec) -> RewardManager:
    options = dict(spec.options)
    options["num_workers"] = min(1, options.get("num_workers", 1))  # one call per batch: one worker is enough
    options["timeout_s"] = spec.batch_timeout_s
    fn = _custom(spec, batch=True, extra_kwargs=spec.reward_kwargs)
    return BatchRewardManager(tokenizer, fn, overlong=spec.legacy_overlong, record_acc=True, **options)


def _dapo(tokenizer: Any, spec: RewardManagerSpec) -> RewardManager:
    cfg = spec.reward_kwargs.get("overlong_buffer_cfg") or {}
    overlong = spec.legacy_overlong
    if cfg.get("enable", False):
        if overlong is not None:
            raise RewardConfigError(
                "the overlong penalty is set twice: reward_model.overlong_buffer.enable and "
                "reward_model.reward_kwargs.overlong_buffer_cfg.enable; keep veRL's reward_kwargs one"
            )
        max_resp_len = spec.reward_kwargs.get("max_resp_len")
        overlong = OverlongShaping(
            len=int(cfg.get("len", 0)),
            max_resp_len=int(spec.max_response_length if max_resp_len is None else max_resp_len),
            penalty_factor=float(cfg.get("penalty_factor", 1.0)),
            log=bool(cfg.get("log", False)),
        )
    return RewardManager(tokenizer, _custom(spec), overlong=overlong, record_acc=True, strip_eos=True, **spec.options)


register_reward_manager("naive", _naive)
register_reward_manager("batch", _batch, reward_kwargs=None)
register_reward_manager("dapo", _dapo, reward_kwargs=("overlong_buffer_cfg", "max_resp_len"))
register_reward_manager("prime", _prime)
