"""GSM8K-style answers: the final answer follows ``####``.

``strict``: the number after the last ``#### `` marker. ``flexible``: the last number anywhere in the response.
Commas, a ``$`` sign and a trailing period are ignored ("#### $1,000." equals 1000); comparison is exact (Decimal).
"""

from __future__ import annotations

import re

from hybridflow.rewards.scorers.numbers import NUMBER, same_number

_STRICT = re.compile(r"####\s*\$?\s*([+-]?[0-9][0-9,]*(?:\.[0-9]+)?)", re.ASCII)
_TAIL_CHARS = 500  # answers sit at the end; scanning only the tail bounds the cost of very long responses


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extraction method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1] if found else None
    found = [m for m in NUMBER.findall(tail) if any(c.isdigit() for c in m)]
    return found[-1] if found else None


def compute_score(
    solution_str: str, ground_truth: object, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if one was found but differs, else 0."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if same_number(answer, ground_truth) else format_score
