"""Tools: what a model may call in an episode.

Two ways to make one:
  * a plain typed function with a docstring -> ``FunctionTool(fn)`` (or ``as_tool(fn)``); its schema is derived by
    ``schema.function_schema``; it may be ``def`` or ``async def``; it returns text (other values are JSON-encoded)
    or a ``ToolResult`` to add a reward / metrics;
  * a ``Tool`` subclass for tools with per-episode state: ``create(**create_kwargs) -> state`` once per episode
    (on the first call), ``execute(state, arguments) -> ToolResult | str``, ``release(state)`` when the episode ends.
    Each method may be sync or async; sync ones run in a thread (``ToolThreads``) so that a slow tool never blocks
    the event loop. A tool that keeps ``Tool``'s no-op create / release (a ``FunctionTool``) is not called for them.

The loop (loop.py) owns timeouts and error handling: a tool only has to compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.schema import function_schema

__all__ = ["FunctionTool", "Tool", "ToolResult", "ToolThreads", "as_tool", "call_maybe_async", "has_own",
           "to_tool_result"]


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


def has_own(tool: Tool, method: str) -> bool:
    """Whether `tool`'s ``create`` / ``release`` does anything: False when it is ``Tool``'s no-op (a FunctionTool's),
    which the loop then does not call at all."""
    return getattr(getattr(tool, method), "__func__", None) is not getattr(Tool, method)


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


class ToolThreads:
    """Where the loop runs sync tool and environment calls: each call in a thread of its own, at most `max_running`
    calls at once (None: no cap).

    A call's timeout counts from when it starts running, never while it waits for a free slot. A call past its timeout
    gives its slot back at once while its thread runs on, abandoned (Python cannot kill a thread): a hung tool costs a
    thread, not a slot that healthy calls wait for. The threads are daemons, so a hung one never holds the process at
    exit either (a ThreadPoolExecutor joins its threads then).
    """

    def __init__(self, max_running: int | None = None):
        if max_running is not None and max_running < 1:
            raise ValueError(f"ToolThreads: max_running must be >= 1 or None, got {max_running}")
        self._slots = None if max_running is None else asyncio.Semaphore(max_running)

    async def run(self, fn: Callable[[], Any], timeout: float | None) -> Any:
        """``fn()`` in a new thread; asyncio.TimeoutError if it runs longer than `timeout` seconds (None: no limit)."""
        if self._slots is None:
            return await self._run(fn, timeout)
        async with self._slots:
            return await self._run(fn, timeout)

    async def _run(self, fn: Callable[[], Any], timeout: float | None) -> Any:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if done.done():  # the call timed out: nobody waits for its value any more
                return
            if error is None:
                done.set_result(value)
            else:
                done.set_exception(error)

        def target() -> None:
            value, error = None, None
            try:
                value = fn()
            except BaseException as e:  # handed to the awaiting episode, which counts it
                # a future cannot carry StopIteration or a non-Exception (SystemExit): wrap them
                error = e if isinstance(e, Exception) and not isinstance(e, StopIteration) else RuntimeError(
                    f"{type(e).__name__} raised in a tool thread: {e}")
            # a closed event loop (RuntimeError): the batch ended without waiting for this call
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, value, error)

        threading.Thread(target=target, name="hybridflow-agent-tool", daemon=True).start()
        return await asyncio.wait_for(done, timeout)


async def call_maybe_async(
    fn: Callable[..., Any], *args: Any, timeout: float | None, threads: ToolThreads | None = None, **kwargs: Any
) -> Any:
    """Call a sync or async callable under one deadline (seconds; None = no limit).

    Sync callables run in a thread of `threads` (a fresh uncapped ToolThreads if None), so the event loop keeps
    serving other episodes; their deadline starts when the thread starts, so time spent waiting for a free slot does
    not count. A sync call that hangs past the deadline raises asyncio.TimeoutError here while its thread runs on.
    """
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args, **kwargs), timeout)
    started: list[float] = []

    def call() -> Any:
        started.append(time.monotonic())
        return fn(*args, **kwargs)

    result = await (threads or ToolThreads()).run(call, timeout)
    if inspect.isawaitable(result):  # e.g. a functools.partial around an async function
        left = None if timeout is None else max(started[0] + timeout - time.monotonic(), 0.0)
        result = await asyncio.wait_for(result, left)
    return result
