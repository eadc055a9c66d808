"""TRL-style environment classes (``GRPOTrainer(environment_factory=MyEnv)``), used as they are.

Such a class is instantiated once per episode; ``reset(**row)`` starts it from the dataset row and may return text
that is appended to the prompt; each public method with type hints and a docstring becomes a tool bound to that
instance (its schema from the signature and docstring); an optional ``get_reward()`` gives the episode's reward.
``close()``, if present, is called at the end. Methods may be sync or async.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hybridflow.agents.environment import Environment
from hybridflow.agents.schema import SchemaError, function_schema
from hybridflow.agents.tools import FunctionTool, Tool

__all__ = ["TRLEnvironment", "tool_method_names", "trl_environment_factory"]

_NOT_TOOLS = frozenset({"reset", "get_reward", "close", "step", "tools"})


def tool_method_names(cls: type) -> list[str]:
    """The public methods of a TRL-style environment class that become tools; raises SchemaError naming a method
    that cannot be described (no type hints / docstring)."""
    names = []
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or name in _NOT_TOOLS or not inspect.isfunction(member):
            continue
        try:
            function_schema(member)
        except SchemaError as e:
            raise SchemaError(f"environment class {cls.__name__}: public method {name!r} cannot become a tool "
                              f"({e}); annotate it and give it a docstring, or make it private (_{name})") from e
        names.append(name)
    if not names:
        raise SchemaError(f"environment class {cls.__name__} has no public methods to offer as tools")
    return names


class TRLEnvironment(Environment):
    """One episode's instance of a TRL-style environment class."""

    def __init__(self, obj: Any):
        self.obj = obj
        self.name = type(obj).__name__
        if hasattr(obj, "get_reward"):
            self.get_reward = obj.get_reward
        if hasattr(obj, "close"):
            self.close = obj.close
        self._tools = self._collect_tools()

    def _collect_tools(self) -> list[Tool]:
        return [FunctionTool(getattr(self.obj, name)) for name in tool_method_names(type(self.obj))]

    def tools(self) -> list[Tool]:
        return list(self._tools)

    def reset(self, **row: Any) -> Any:
        reset = getattr(self.obj, "reset", None)
        if reset is None:
            return None
        params = inspect.signature(reset).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            row = {k: v for k, v in row.items() if k in params}  # a reset(self) or reset(self, seed) takes less
        return reset(**row)


def trl_environment_factory(factory: Callable[[], Any]) -> Callable[[], TRLEnvironment]:
    """A class (or zero-argument factory) of TRL-style environments -> an env_factory for AgentLoop."""
    if not callable(factory):
        raise TypeError(f"environment_factory must be a class or a zero-argument callable, got {factory!r}")
    if isinstance(factory, type):
        tool_method_names(factory)  # a method that cannot be a tool is a setup error: say so now, not per episode
    return lambda: TRLEnvironment(factory())
