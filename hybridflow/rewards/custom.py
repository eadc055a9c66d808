"""Loading a user's reward function from ``path/to/file.py:function_name`` (veRL's custom_reward_function).

Two signatures, as in veRL:
  * per sample (reward managers naive, dapo, prime): ``fn(data_source, solution_str, ground_truth, extra_info=None)``
    returning a number or a dict with ``"score"``;
  * per batch (reward manager ``batch``): ``fn(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)``
    returning a list with one number or dict per row.
Parameters are passed by those names (or taken by ``**kwargs``). ``custom_reward_function.reward_kwargs`` are added
to every call, overriding same-named arguments (veRL merges them the same way). The loaded function is wrapped in a
small picklable object that worker processes re-load from the same file, so scoring can run in other processes.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from hybridflow.plugins import PluginError, import_file
from hybridflow.rewards.registry import RewardConfigError

__all__ = ["CustomRewardFunction", "load_custom_reward_fn"]

SAMPLE_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_PARAMS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def _load_module(path: str) -> Any:
    try:
        return import_file(path, what="custom reward file")
    except PluginError as e:
        raise RewardConfigError(str(e)) from e


def _check_signature(fn: Any, where: str, required: tuple[str, ...], kwargs: dict[str, Any]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature; the first call will tell
    params = sig.parameters
    passed = (*required, *kwargs)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [] if takes_any else [name for name in passed if name not in params]
    extra_required = [
        name for name, p in params.items()
        if name not in passed and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if missing or extra_required:
        shape = "per-batch" if required == BATCH_PARAMS else "per-sample"
        hint = (
            " (a per-batch function: is reward_model.reward_manager=batch what you meant?)"
            if required == SAMPLE_PARAMS and all(p in params for p in BATCH_PARAMS)
            else " (a per-sample function: use reward_model.reward_manager=naive)"
            if required == BATCH_PARAMS and all(p in params for p in SAMPLE_PARAMS)
            else ""
        )
        raise RewardConfigError(
            f"custom reward function {where} has signature {sig}; as a {shape} reward function it must accept "
            f"({', '.join(required)}{', **kwargs' if required == BATCH_PARAMS else '=None'})"
            + (f" - missing {missing}" if missing else "")
            + (f" - unexpected required {extra_required}" if extra_required else "")
            + hint
            + (f"; custom_reward_function.reward_kwargs passes {sorted(kwargs)}" if kwargs else "")
        )


class CustomRewardFunction:
    """``fn`` from ``path``, picklable as (path, name, kwargs, batch): each process that unpickles it loads the file
    itself. ``batch=True``: the per-batch signature; ``kwargs`` are added to every call."""

    def __init__(self, path: str, name: str, kwargs: dict[str, Any] | None = None, batch: bool = False) -> None:
        self.path = path
        self.name = name
        self.kwargs = dict(kwargs or {})
        self.batch = batch
        module = _load_module(path)
        fn = getattr(module, name, None)
        if fn is None:
            public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise RewardConfigError(
                f"custom reward file {path!r} has no function {name!r}; functions defined there: {public}"
            )
        if not callable(fn):
            raise RewardConfigError(f"{path}:{name} is a {type(fn).__name__}, not a function")
        _check_signature(fn, f"{path}:{name}", BATCH_PARAMS if batch else SAMPLE_PARAMS, self.kwargs)
        self._fn = fn

    def __call__(self, *args: Any, **task: Any) -> Any:
        """Per sample: (data_source, solution_str, ground_truth, extra_info); per batch: the plural names."""
        task = {**dict(zip(BATCH_PARAMS if self.batch else SAMPLE_PARAMS, args)), **task}
        return self._fn(**{**task, **self.kwargs})

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return CustomRewardFunction, (self.path, self.name, self.kwargs, self.batch)

    def __repr__(self) -> str:
        return f"CustomRewardFunction({self.path}:{self.name}{', batch' if self.batch else ''})"


def load_custom_reward_fn(
    spec: str, function_name: str | None = None, *, kwargs: dict[str, Any] | None = None, batch: bool = False
) -> CustomRewardFunction:
    """``"path/to/file.py:function_name"`` (or path plus `function_name`) -> the callable, checked against the
    per-sample signature (or the per-batch one with ``batch=True``); `kwargs` are passed on every call."""
    if function_name is None:
        path, sep, function_name = spec.rpartition(":")
        if not sep or not path or not function_name:
            raise RewardConfigError(
                f"custom reward function {spec!r} must be given as 'path/to/file.py:function_name'"
            )
    else:
        path = spec
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise RewardConfigError(
            f"custom reward file {path!r} does not exist; give the path to a .py file as 'path/to/file.py:function_name'"
        )
    return CustomRewardFunction(path, function_name, kwargs, batch)
