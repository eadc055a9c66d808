"""Exact comparison of numeric answers written as text (ASCII digits only)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Only ASCII digits count: "٤٢" or fullwidth "４２" are not read as 42 (str.isdigit / int() would accept them).
NUMBER = re.compile(r"[+-]?(?:[0-9][0-9,]*(?:\.[0-9]*)?|\.[0-9]+)", re.ASCII)
_MAX_CHARS = 1000  # longer digit strings are not answers; refuse them rather than spend time on them


def parse_number(text: str) -> Decimal | None:
    """'1,234.50' / '$12' / '-3.' -> Decimal; None if `text` is not one plain number."""
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not t or len(t) > _MAX_CHARS or not re.fullmatch(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", t, re.ASCII):
        return None
    try:
        return Decimal(t)
    except InvalidOperation:
        return None


def same_number(a: str, b: object) -> bool:
    """Whether text `a` and ground truth `b` (text or number) are the same number, exactly."""
    x = parse_number(a)
    y = parse_number(str(b)) if not isinstance(b, bool) else None
    return x is not None and y is not None and x == y
