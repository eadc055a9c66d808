"""Countdown: combine the given numbers with + - * / and parentheses to reach the target.

ground_truth is ``{"target": int, "numbers": [int, ...]}`` (a dict, or the same as a JSON string). The equation is
read from the last ``<answer>...</answer>`` (the usual countdown prompt format) or else the last ``#### `` line; an
``= target`` suffix is allowed. Each given number must be used exactly once (``use_all_numbers=False``: at most
once). Arithmetic is exact (fractions); the expression is parsed, never ``eval``-ed.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction
from typing import Any

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/().\s]+", re.ASCII)
_MAX_EQUATION_CHARS = 200
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


def parse_ground_truth(ground_truth: Any) -> tuple[Fraction, list[int]]:
    if isinstance(ground_truth, str):
        ground_truth = json.loads(ground_truth)
    if not isinstance(ground_truth, dict) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(f"countdown ground truth must be {{'target': int, 'numbers': [int, ...]}}, got {ground_truth!r}")
    numbers = ground_truth["numbers"]
    numbers = numbers.tolist() if hasattr(numbers, "tolist") else list(numbers)
    return Fraction(int(ground_truth["target"])), [int(n) for n in numbers]


def extract_equation(solution_str: str) -> str | None:
    tags = _ANSWER_TAG.findall(solution_str)
    if tags:
        equation = tags[-1]
    else:
        marker = solution_str.rfind("####")
        if marker < 0:
            return None
        equation = solution_str[marker + 4 :].split("\n", 1)[0]
    equation = equation.split("=", 1)[0].strip()
    if not equation or len(equation) > _MAX_EQUATION_CHARS or not _ALLOWED_CHARS.fullmatch(equation):
        return None
    return equation


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    raise ValueError(f"not allowed in a countdown equation: {ast.dump(node)[:40]}")


def compute_score(
    solution_str: str, ground_truth: Any, format_score: float = 0.1, score: float = 1.0, use_all_numbers: bool = True
) -> float:
    """`score` if the equation uses the numbers correctly and equals the target, `format_score` if an equation was
    given but is wrong, 0 if none was found."""
    target, numbers = parse_ground_truth(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(equation, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return format_score
    given, taken = Counter(numbers), Counter(used)
    numbers_ok = taken == given if use_all_numbers else not (taken - given)
    return score if numbers_ok and value == target else format_score
