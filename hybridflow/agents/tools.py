"""Tools: what a model may call in an episode.

Two ways to make one:
  * a plain typed function with a docstring -> ``FunctionTool(fn)`` (or ``as_tool(fn)``); its schema is derived by
    ``schema.function_schema``; it may be ``def`` or ``async def``; it returns text (other values are JSON-encoded)
    or a ``ToolResult`` to add a reward / metrics;
  * a ``Tool`` subclass for tools with per-episode state: ``create(**create_kwargs) -> state`` once per episode
    (on the first call), ``execute(state, arguments) -> ToolResult | str``, ``release(state)`` when the episode ends.
    Each method may be sync or async; sync ones run in a thread so that a slow tool never blocks the event loop.

The loop (loop.py) owns timeouts and error handling: a tool only has to compute.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.schema import function_schema

__all__ = ["FunctionTool", "Tool", "ToolResult", "as_tool", "call_maybe_async", "to_tool_result"]


@dataclass
class ToolResult:
    """What a tool call returns: the observation text, an optional reward for this call, optional metrics."""

    text: str
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Tool:
    """A named, described tool with JSON-schema ``parameters``; override ``execute`` (and create/release if stateful)."""

    def __init__(self, name: str, description: str, parameters: dict[str, Any] | None = None):
        if not name or not isinstance(name, str):
            raise ValueError(f"a tool needs a non-empty string name, got {name!r}")
        self.name = name
        self.description = description
        self.parameters = parameters or {"type": "object", "properties": {}, "required": []}
        if self.parameters.get("type", "object") != "object":
            raise ValueError(f"tool {name!r}: parameters must be a JSON-schema object, got type {self.parameters['type']!r}")

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema (what chat templates render in the system prompt)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def create(self, **create_kwargs: Any) -> Any:
        """Per-episode state, made on the episode's first call of this tool (kwargs: the row's tools_kwargs)."""
        return None

    def execute(self, state: Any, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult | str:
        raise NotImplementedError(f"tool {self.name!r} ({type(self).__name__}) does not implement execute()")

    def release(self, state: Any) -> None:
        """Free the episode's state (called once at the episode's end if create() ran)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionTool(Tool):
    """A stateless tool around a typed function: ``execute`` calls ``fn(**arguments)``."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, description: str | None = None):
        schema = function_schema(fn, name=name, description=description)["function"]
        super().__init__(schema["name"], schema["description"], schema["parameters"])
        self.fn = fn
        if inspect.iscoroutinefunction(fn):
            self.execute = self._execute_async  # type: ignore[method-assign]

    def execute(self, state: Any, arguments: dict[str, Any], **execute_kwargs: Any) -> Any:
        return self.fn(**arguments)

    async def _execute_async(self, state: Any, arguments: dict[str, Any], **execute_kwargs: Any) -> Any:
        return await self.fn(**arguments)


def as_tool(obj: Any) -> Tool:
    """A Tool instance as is, a Tool subclass instantiated without arguments, a function wrapped in FunctionTool."""
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, type) and issubclass(obj, Tool):
        return obj()
    if callable(obj):
        return FunctionTool(obj)
    raise TypeError(f"cannot make a tool from {obj!r}; pass a typed function with a docstring or a Tool")


def to_tool_result(value: Any) -> ToolResult:
    """Normalise what a tool returned: ToolResult, text, (text, reward, metrics) as veRL tools return, an object with
    ``.text`` (veRL's ToolResponse), or any JSON-encodable value."""
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, str):
        return ToolResult(value)
    if value is None:
        return ToolResult("")
    if isinstance(value, tuple) and 1 <= len(value) <= 3:
        text = to_tool_result(value[0]).text
        reward = float(value[1]) if len(value) > 1 and value[1] is not None else None
        metrics = dict(value[2]) if len(value) > 2 and value[2] else {}
        return ToolResult(text, reward, metrics)
    if hasattr(value, "text") and not isinstance(value, (dict, list)):
        return ToolResult("" if value.text is None else str(value.text))
    if isinstance(value, dict) and set(value) <= {"text", "image", "video"} and "text" in value:
        return ToolResult(str(value["text"]))
    try:
        return ToolResult(json.dumps(value, ensure_ascii=False, default=str))
    except (TypeError, ValueError):
        return ToolResult(str(value))


async def call_maybe_async(
    fn: Callable[..., Any], *args: Any, timeout: float | None, executor: Executor | None = None, **kwargs: Any
) -> Any:
    """Call a sync or async callable under one deadline (seconds; None = no limit).

    Sync callables run in `executor` (a thread) so the event loop keeps serving other episodes; a sync call that hangs
    past the deadline raises asyncio.TimeoutError here while its thread runs on (Python cannot kill a thread), which
    is why the loop gives tools their own executor.
    """
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(deadline - time.monotonic(), 0.0)

    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args, **kwargs), left())
    loop = asyncio.get_running_loop()
    result = await asyncio.wait_for(loop.run_in_executor(executor, lambda: fn(*args, **kwargs)), left())
    if inspect.isawaitable(result):  # e.g. a functools.partial around an async function
        result = await asyncio.wait_for(result, left())
    return result
