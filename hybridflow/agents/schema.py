"""JSON schemas for tools: derived from a typed Python function, and checked against a model's call arguments.

``function_schema(fn)`` reads the signature (type hints give JSON types, parameters without a default are required)
and a Google-style docstring (the summary becomes the description, ``Args:`` lines describe the parameters):

    def multiply(a: int, b: int) -> int:
        '''Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        '''

-> ``{"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.",
"parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first factor"}, ...},
"required": ["a", "b"]}}}`` (the OpenAI function format that chat templates render and veRL's tool files hold).

``check_arguments(parameters, arguments)`` returns None or a message saying which argument is wrong and why; the
loop turns that message into the tool's observation, so the model is told rather than the run crashing.
"""

from __future__ import annotations

import collections.abc
import enum
import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any

__all__ = ["SchemaError", "check_arguments", "function_schema", "parse_docstring"]


class SchemaError(TypeError):
    """A function cannot be described as a tool (a parameter without a type hint, an unsupported type...)."""


_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    """A type hint -> a JSON-schema fragment (without description)."""
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if hint is Any:
        return {}
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        out: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _SCALARS:
            out["type"] = _SCALARS[next(iter(kinds))]
        return out
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _json_type(rest[0], where)
        return {"anyOf": [_json_type(a, where) for a in rest]}
    if hint in (list, tuple, set) or origin in (list, tuple, set, collections.abc.Sequence):
        out = {"type": "array"}
        if args and args[0] is not Ellipsis:
            out["items"] = _json_type(args[0], where)
        return out
    if hint is dict or origin is dict:
        return {"type": "object"}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _json_type(typing.Literal[tuple(m.value for m in hint)], where)  # type: ignore[misc]
    raise SchemaError(
        f"{where}: type {hint!r} has no JSON-schema equivalent; use str, int, float, bool, list[...], dict, "
        "Literal[...] or an Enum (or write the schema by hand with Tool(parameters=...))"
    )


_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s*\*{0,2}(\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """A Google-style docstring -> (description, {argument name: description}).

    The description is the text before the first section header; an argument's description may continue on
    more-indented lines.
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    args: dict[str, str] = {}
    section = None
    current = None
    arg_indent = None
    for line in lines:
        header = _SECTION.match(line)
        if header:
            section = header.group(1).lower()
            current, arg_indent = None, None
            continue
        if section is None:
            summary.append(line)
        elif section in ("args", "arguments", "parameters") and line.strip():
            indent = len(line) - len(line.lstrip())
            m = _ARG_LINE.match(line)
            if m and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = m.group(1)
                args[current] = m.group(3).strip()
            elif current is not None:
                args[current] = (args[current] + " " + line.strip()).strip()
    return " ".join(s.strip() for s in summary if s.strip()), args


def function_schema(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> dict[str, Any]:
    """The OpenAI function schema of a typed Python function (see the module docstring)."""
    fn_name = name or getattr(fn, "__name__", None)
    if not fn_name or fn_name == "<lambda>":
        raise SchemaError(f"cannot name a tool after {fn!r}; pass name=...")
    where = f"tool {fn_name!r}"
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise SchemaError(f"{where}: its type hints cannot be resolved ({e})") from e
    doc_description, arg_docs = parse_docstring(inspect.getdoc(fn))
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, p in sig.parameters.items():
        if pname in ("self", "cls"):
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise SchemaError(f"{where}: *args / **kwargs ({pname}) cannot be described; name each argument")
        if pname not in hints:
            raise SchemaError(f"{where}: argument {pname!r} has no type hint; annotate it (e.g. {pname}: int)")
        prop = _json_type(hints[pname], f"{where}, argument {pname!r}")
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        properties[pname] = prop
        if p.default is p.empty:
            required.append(pname)
    desc = description if description is not None else doc_description
    if not desc:
        raise SchemaError(f"{where}: no description; give the function a docstring or pass description=...")
    return {
        "type": "function",
        "function": {
            "name": fn_name,
            "description": desc,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _matches(value: Any, spec: dict[str, Any]) -> bool:
    if "anyOf" in spec:
        return any(_matches(value, s) for s in spec["anyOf"])
    if "enum" in spec and value not in spec["enum"]:
        return False
    kind = spec.get("type")
    if kind is None:
        return True
    if isinstance(kind, list):
        return any(_matches(value, {**spec, "type": k}) for k in kind)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":  # True is not an integer; nor is 3.0 (the function would receive a float)
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        items = spec.get("items")
        return isinstance(value, list) and (items is None or all(_matches(v, items) for v in value))
    if kind == "object":
        return isinstance(value, dict)
    if kind == "null":
        return value is None
    return True  # a type this checker does not know: let the tool decide


def check_arguments(parameters: dict[str, Any], arguments: Any) -> str | None:
    """None if `arguments` fit the JSON-schema object `parameters`, else a message naming the bad argument."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties = parameters.get("properties") or {}
    missing = [k for k in parameters.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if parameters.get("additionalProperties", True) is False or properties:
        unknown = [k for k in arguments if k not in properties]
        if unknown:
            return f"unknown argument(s) {unknown}; expected {sorted(properties)}"
    for key, value in arguments.items():
        spec = properties.get(key)
        if spec is not None and not _matches(value, spec):
            want = spec.get("type") or spec.get("enum") or spec.get("anyOf")
            return f"argument {key!r} must be {want}, got {type(value).__name__} {value!r:.60}"
    return None
