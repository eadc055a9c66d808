"""Tool-call parsers: the model's generated text -> (content, tool calls), chosen by name.

A parser never raises on what a model wrote: a call it cannot read comes back as a ``ToolCall`` with ``error`` set
(``malformed_json``, ``missing_name``, ``bad_arguments``, ``unterminated``) and the loop answers it with an error
observation, counted in the episode's metrics. Unknown tool names and wrong argument types are checked by the loop
against the tools' schemas, since only it knows which tools exist.

Registry (``TOOL_CALL_PARSERS``, the project's one ``plugins.Registry``): ``get_parser("hermes")``, or a
``package.module:attr`` / ``path/to/file.py:attr`` import path to a parser class or instance;
``register_parser(name, parser)`` adds one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from hybridflow.plugins import Registry

__all__ = ["TOOL_CALL_PARSERS", "HermesToolParser", "ParsedResponse", "ToolCall", "ToolCallParser", "get_parser",
           "parser_names", "register_parser"]


@dataclass
class ToolCall:
    """One call the model asked for. ``arguments`` is a dict when readable; ``error`` names why it is not."""

    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None
    detail: str = ""


@dataclass
class ParsedResponse:
    content: str  # the text outside tool-call markup
    calls: list[ToolCall] = field(default_factory=list)


@runtime_checkable
class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedResponse: ...


class HermesToolParser:
    """Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn.

    ``arguments`` may also be a JSON string holding the object (some models write it that way).
    """

    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self) -> None:
        self._pattern = re.compile(re.escape(self.start) + r"(.*?)" + re.escape(self.end), re.DOTALL)

    def parse(self, text: str) -> ParsedResponse:
        calls = [self._read(m.group(1)) for m in self._pattern.finditer(text)]
        content = self._pattern.sub("", text)
        # An opening tag with no closing one (the turn ran out of tokens, or the model forgot it) is still a call
        # the model meant to make: report it rather than silently treating the turn as a final answer.
        tail = content.find(self.start)
        if tail >= 0:
            calls.append(ToolCall(None, None, content[tail:], "unterminated", f"{self.start} without {self.end}"))
            content = content[:tail]
        return ParsedResponse(content.strip(), calls)

    @staticmethod
    def _read(body: str) -> ToolCall:
        raw = body.strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            return ToolCall(None, None, raw, "malformed_json", f"invalid JSON ({e.msg} at char {e.pos})")
        if not isinstance(obj, dict):
            return ToolCall(None, None, raw, "malformed_json", f"expected a JSON object, got {type(obj).__name__}")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return ToolCall(None, None, raw, "missing_name", 'the call has no string "name"')
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                return ToolCall(name, None, raw, "bad_arguments", f'"arguments" is a string but not JSON ({e.msg})')
        if not isinstance(args, dict):
            return ToolCall(name, None, raw, "bad_arguments", f'"arguments" must be an object, got {type(args).__name__}')
        return ToolCall(name, args, raw)


TOOL_CALL_PARSERS: Registry[Any] = Registry("tool-call parser", "hybridflow.agents.register_parser(name, parser)")
TOOL_CALL_PARSERS.add("hermes", HermesToolParser)
TOOL_CALL_PARSERS.add("qwen", HermesToolParser)


def register_parser(name: str, parser: Any, override: bool = False) -> None:
    """Add a parser class (instantiated without arguments) or instance under `name`."""
    TOOL_CALL_PARSERS.add(name, parser, override=override)


def parser_names() -> list[str]:
    return TOOL_CALL_PARSERS.names()


def get_parser(name: str) -> ToolCallParser:
    """A parser by registered name or ``package.module:attr`` import path (PluginError if neither)."""
    entry = TOOL_CALL_PARSERS.get(name)
    parser = entry() if isinstance(entry, type) else entry
    if not isinstance(parser, ToolCallParser):
        raise TypeError(f"tool-call parser {name!r} ({parser!r}) has no parse(text) -> ParsedResponse method")
    return parser
