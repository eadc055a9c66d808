"""Tool-call parsing, function -> schema, argument checking, tool results."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from hybridflow.agents import FunctionTool, ToolResult, as_tool, check_arguments, function_schema, get_parser
from hybridflow.agents.parsers import TOOL_CALL_PARSERS, HermesToolParser, parser_names, register_parser
from hybridflow.agents.schema import SchemaError, parse_docstring
from hybridflow.agents.tools import call_maybe_async, to_tool_result


def test_hermes_parses_calls_and_content():
    p = get_parser("hermes")
    text = ('Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    out = p.parse(text)
    assert out.content == "Let me compute."
    assert [(c.name, c.arguments, c.error) for c in out.calls] == [
        ("multiply", {"a": 3, "b": 4}, None), ("add", {"a": 1, "b": 2}, None)]
    assert p.parse("The answer is 12.").calls == []
    assert p.parse("The answer is 12.").content == "The answer is 12."


@pytest.mark.parametrize("body, error", [
    ('{"name": "multiply", "arguments": {"a": 3,}}', "malformed_json"),
    ('["multiply", 3]', "malformed_json"),
    ('{"arguments": {"a": 3}}', "missing_name"),
    ('{"name": "multiply", "arguments": [1, 2]}', "bad_arguments"),
    ('{"name": "multiply", "arguments": "a=3"}', "bad_arguments"),
])
def test_hermes_reports_unreadable_calls(body, error):
    calls = get_parser("qwen").parse(f"x <tool_call>{body}</tool_call>").calls
    assert len(calls) == 1 and calls[0].error == error and calls[0].detail


def test_hermes_reports_an_unterminated_call():
    out = HermesToolParser().parse('ok <tool_call>{"name": "multiply", "arguments": {"a": 3')
    assert out.content == "ok"
    assert [c.error for c in out.calls] == ["unterminated"]


def test_parser_registry():
    assert {"hermes", "qwen"} <= set(parser_names())
    assert isinstance(get_parser("hybridflow.agents.parsers:HermesToolParser"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        get_parser("nope")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        get_parser("hybridflow.agents.parsers:Missing")
    with pytest.raises(ValueError, match="already registered"):
        register_parser("hermes", HermesToolParser)
    register_parser("broken-for-test", object(), override=True)
    try:
        with pytest.raises(TypeError, match="no parse"):
            get_parser("broken-for-test")
    finally:
        TOOL_CALL_PARSERS.remove("broken-for-test")


def multiply(a: int, b: int, note: str | None = None) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor,
            on two lines
        note (str): ignored
    Returns:
        the product
    """
    return a * b


def test_function_schema_from_signature_and_docstring():
    assert function_schema(multiply) == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first factor"},
                    "b": {"type": "integer", "description": "the second factor, on two lines"},
                    "note": {"type": "string", "description": "ignored"},
                },
                "required": ["a", "b"],
            },
        },
    }


def test_function_schema_types_and_errors():
    def pick(mode: Literal["fast", "slow"], xs: list[float], opts: dict, flag: bool = False) -> str:
        """Pick."""
        return mode

    props = function_schema(pick)["function"]["parameters"]["properties"]
    assert props["mode"] == {"enum": ["fast", "slow"], "type": "string"}
    assert props["xs"] == {"type": "array", "items": {"type": "number"}}
    assert props["opts"] == {"type": "object"} and props["flag"] == {"type": "boolean"}

    def untyped(a, b: int) -> int:
        """Untyped."""
        return b

    with pytest.raises(SchemaError, match="argument 'a' has no type hint"):
        function_schema(untyped)

    def undocumented(a: int) -> int:
        return a

    with pytest.raises(SchemaError, match="no description"):
        function_schema(undocumented)
    assert function_schema(undocumented, description="d")["function"]["description"] == "d"

    def star(*a: int) -> int:
        """Star."""
        return 0

    with pytest.raises(SchemaError, match=r"\*args"):
        function_schema(star)
    assert parse_docstring(None) == ("", {})


def test_check_arguments():
    params = function_schema(multiply)["function"]["parameters"]
    assert check_arguments(params, {"a": 1, "b": 2}) is None
    assert "missing required argument(s) ['b']" in check_arguments(params, {"a": 1})
    assert "unknown argument(s) ['c']" in check_arguments(params, {"a": 1, "b": 2, "c": 3})
    assert "argument 'a' must be integer, got str" in check_arguments(params, {"a": "1", "b": 2})
    assert "got bool" in check_arguments(params, {"a": True, "b": 2})
    assert "got float" in check_arguments(params, {"a": 1.5, "b": 2})
    assert "must be a JSON object" in check_arguments(params, [1, 2])


def test_tools_and_results():
    tool = as_tool(multiply)
    assert isinstance(tool, FunctionTool) and tool.name == "multiply"
    assert tool.schema() == function_schema(multiply)

    async def fetch(url: str) -> dict:
        """Fetch a page."""
        await asyncio.sleep(0)
        return {"url": url, "status": 200}

    atool = FunctionTool(fetch)
    out = asyncio.run(call_maybe_async(atool.execute, None, {"url": "u"}, timeout=5))
    assert to_tool_result(out).text == '{"url": "u", "status": 200}'
    assert to_tool_result(("t", 1.5, {"m": 1.0})) == ToolResult("t", 1.5, {"m": 1.0})
    assert to_tool_result(None).text == "" and to_tool_result(7).text == "7"
    assert to_tool_result({"text": "hi"}).text == "hi"
    with pytest.raises(TypeError, match="cannot make a tool"):
        as_tool(3)
