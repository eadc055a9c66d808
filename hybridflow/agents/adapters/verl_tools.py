"""veRL's tool config file (``actor_rollout_ref.rollout.multi_turn.tool_config_path``), read as veRL reads it.

    tools:
      - class_name: my_pkg.tools.Calculator       # importable module path + class
        config: {type: native, ...}               # passed to the constructor; type: native (mcp is not supported)
        tool_schema:                              # OpenAI function schema; optional if the class provides one
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, properties: ..., required: ...}}

Each class is constructed as veRL does, ``Class(config=config, tool_schema=schema)``, where ``schema`` offers the
attribute access of veRL's pydantic ``OpenAIFunctionToolSchema`` (``schema.function.name``, ``.model_dump()``). Per
episode the adapter calls ``create(create_kwargs=...)`` (returning an instance id, or ``(id, response)`` in newer
veRL), ``execute(instance_id, parameters, **execute_kwargs) -> (response, reward, metrics)`` and
``release(instance_id)``; create/execute kwargs come from the row's ``tools_kwargs[tool name]`` like in veRL.
A class that subclasses veRL's own ``BaseTool`` needs veRL importable; duck-typed classes need nothing.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

from hybridflow.agents.tools import Tool

__all__ = ["ToolConfigError", "VerlTool", "load_verl_tool_config"]


class ToolConfigError(ValueError):
    """The tool config file is malformed or names something that cannot be imported."""


class _Schema(dict):
    """A dict with attribute access, standing in for veRL's pydantic schema models."""

    def __getattr__(self, key: str) -> Any:
        try:
            value = self[key]
        except KeyError as e:
            raise AttributeError(key) from e
        return _Schema(value) if isinstance(value, dict) and not isinstance(value, _Schema) else value

    def model_dump(self, **_: Any) -> dict[str, Any]:
        def plain(v: Any) -> Any:
            return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v
        return plain(self)


def _schema_dict(schema: Any) -> dict[str, Any]:
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump(exclude_unset=True, exclude_none=True)
    return dict(schema)


class VerlTool(Tool):
    """Our Tool interface over one veRL-style tool object."""

    def __init__(self, inner: Any, schema: dict[str, Any]):
        fn = schema.get("function") or {}
        super().__init__(fn.get("name") or getattr(inner, "name", ""), fn.get("description", ""),
                         fn.get("parameters") or None)
        self.inner = inner

    async def create(self, **create_kwargs: Any) -> Any:
        result = await _maybe_await(self.inner.create(create_kwargs=create_kwargs))
        return result[0] if isinstance(result, tuple) else result

    async def execute(self, state: Any, arguments: dict[str, Any], **execute_kwargs: Any) -> Any:
        return await _maybe_await(self.inner.execute(state, arguments, **execute_kwargs))

    async def release(self, state: Any) -> None:
        await _maybe_await(self.inner.release(state))


async def _maybe_await(value: Any) -> Any:
    # veRL's tools are async; a user's tool with a plain def works too (it then runs on the event loop)
    return await value if inspect.isawaitable(value) else value


def _import_class(class_name: str, where: str) -> type:
    module_name, _, attr = class_name.rpartition(".")
    if not module_name:
        raise ToolConfigError(f"{where}: class_name {class_name!r} must be a dotted path 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ToolConfigError(f"{where}: cannot import module {module_name!r} for class_name {class_name!r} ({e}); "
                              "install the package or put its folder on PYTHONPATH") from e
    if not hasattr(module, attr):
        raise ToolConfigError(f"{where}: module {module_name!r} has no class {attr!r} (class_name {class_name!r})")
    return getattr(module, attr)


def load_verl_tool_config(path: str | os.PathLike) -> list[VerlTool]:
    """Read a veRL tool config file and construct its tools."""
    from omegaconf import OmegaConf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ToolConfigError(f"tool config file {path!r} does not exist (multi_turn.tool_config_path)")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:
        raise ToolConfigError(f"tool config file {path!r} is not valid YAML: {e}") from e
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"tool config file {path!r} needs a non-empty top-level 'tools:' list")
    tools: list[VerlTool] = []
    for i, entry in enumerate(entries):
        where = f"tool config {path!r}, tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolConfigError(f"{where}: each tool needs a 'class_name: package.module.Class'")
        config = dict(entry.get("config") or {})
        kind = config.get("type", "native")
        if kind != "native":
            raise ToolConfigError(f"{where}: config.type {kind!r} is not supported; only 'native' tools "
                                  "(Python classes) are (MCP / benchmax tool servers are not)")
        schema = entry.get("tool_schema")
        if schema is not None:
            fn = schema.get("function") if isinstance(schema, dict) else None
            if schema.get("type") != "function" or not isinstance(fn, dict) or not fn.get("name"):
                raise ToolConfigError(f"{where}: tool_schema must be {{type: function, function: {{name, "
                                      "description, parameters}}}}")
            schema = _Schema(schema)
        cls = _import_class(entry["class_name"], where)
        try:
            inner = cls(config=config, tool_schema=schema)
        except Exception as e:
            raise ToolConfigError(f"{where}: {entry['class_name']}(config=..., tool_schema=...) raised "
                                  f"{type(e).__name__}: {e}") from e
        if schema is None:
            if not hasattr(inner, "get_openai_tool_schema"):
                raise ToolConfigError(f"{where}: no tool_schema in the file and {entry['class_name']} has no "
                                      "get_openai_tool_schema()")
            schema = inner.get_openai_tool_schema()
        missing = [m for m in ("create", "execute", "release") if not callable(getattr(inner, m, None))]
        if missing:
            raise ToolConfigError(f"{where}: {entry['class_name']} lacks {missing}; a veRL tool has async "
                                  "create / execute / release")
        tool = VerlTool(inner, _schema_dict(schema))
        if not tool.name:
            raise ToolConfigError(f"{where}: the tool has no name (tool_schema.function.name)")
        tools.append(tool)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolConfigError(f"tool config {path!r}: tool names repeat: {names}")
    return tools
