"""Loading a user's reward function from ``path/to/file.py:function_name`` (veRL's custom_reward_function).

The function must accept ``(data_source, solution_str, ground_truth, extra_info=None)`` (by those names, or
``**kwargs``) and return a number or a dict with ``"score"``. The loaded function is wrapped in a small picklable
object that worker processes re-load from the same file, so scoring can run in other processes.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from hybridflow.plugins import PluginError, import_file
from hybridflow.rewards.registry import RewardConfigError

__all__ = ["CustomRewardFunction", "load_custom_reward_fn"]

_REQUIRED_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")


def _load_module(path: str) -> Any:
    try:
        return import_file(path, what="custom reward file")
    except PluginError as e:
        raise RewardConfigError(str(e)) from e


def _check_signature(fn: Any, where: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature; the first call will tell
    params = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    missing = [name for name in _REQUIRED_PARAMS if name not in params]
    extra_required = [
        name for name, p in params.items()
        if name not in _REQUIRED_PARAMS and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if missing or extra_required:
        raise RewardConfigError(
            f"custom reward function {where} has signature {sig}; it must accept "
            "(data_source, solution_str, ground_truth, extra_info=None)"
            + (f" - missing {missing}" if missing else "")
            + (f" - unexpected required {extra_required}" if extra_required else "")
        )


class CustomRewardFunction:
    """``fn`` from ``path``, picklable as (path, name): each process that unpickles it loads the file itself."""

    def __init__(self, path: str, name: str) -> None:
        self.path = path
        self.name = name
        module = _load_module(path)
        fn = getattr(module, name, None)
        if fn is None:
            public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise RewardConfigError(
                f"custom reward file {path!r} has no function {name!r}; functions defined there: {public}"
            )
        if not callable(fn):
            raise RewardConfigError(f"{path}:{name} is a {type(fn).__name__}, not a function")
        _check_signature(fn, f"{path}:{name}")
        self._fn = fn

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        return self._fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return CustomRewardFunction, (self.path, self.name)

    def __repr__(self) -> str:
        return f"CustomRewardFunction({self.path}:{self.name})"


def load_custom_reward_fn(spec: str, function_name: str | None = None) -> CustomRewardFunction:
    """``"path/to/file.py:function_name"`` (or path plus `function_name`) -> the callable, checked."""
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
    return CustomRewardFunction(path, function_name)
