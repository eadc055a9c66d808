"""GSM8K-style answers: the final answer follows ``####``.

Three extraction rules:

``strict`` (the default, the rule veRL's ``openai/gsm8k`` scorer applies, so reward curves are comparable):
    only the last 300 characters are read; the answer is the last ``"#### "`` (four hashes and exactly one space)
    followed by a run of digits, dots and commas, optionally after one ``-``; commas are removed and the result is
    compared *as text* with the ground truth. So ``"#### 1,000"`` matches ``"1000"``, but ``"####72"``,
    ``"#### $72"``, ``"#### 72.0"`` and ``"#### 72."`` do not match ``"72"``.
``flexible`` (veRL's other rule): the last run of digits/dots/commas (optionally after ``-``) in the same window that
    is not a lone ``.``; compared as text, commas kept.
``lenient`` (opt-in, data_source ``hybridflow/gsm8k_lenient``): ``####`` with any spacing and an optional ``$``,
    read from the last 500 characters, compared by value: ``"#### $1,000."`` and ``"####1000.0"`` both equal 1000.
    ASCII digits only, exact Decimal comparison.

A ground truth that is not a string (a number read from JSON) is compared as ``str(ground_truth)`` by the text rules.
"""

from __future__ import annotations

import re

from hybridflow.rewards.scorers.numbers import same_number

__all__ = ["METHODS", "compute_score", "extract_answer"]

METHODS = ("strict", "flexible", "lenient")

# veRL reads the last 300 characters only (answers sit at the end; this bounds regex time on long responses).
WINDOW_CHARS = 300
LENIENT_WINDOW_CHARS = 500

_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_FLEXIBLE = re.compile(r"(-?[0-9.,]+)")
_LENIENT = re.compile(r"####\s*\$?\s*([+-]?[0-9][0-9,]*(?:\.[0-9]+)?)", re.ASCII)


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer text `method` reads from `solution_str`, or None when there is none."""
    if method not in METHODS:
        raise ValueError(f"gsm8k extraction method must be one of {list(METHODS)}, got {method!r}")
    if method == "lenient":
        found = _LENIENT.findall(solution_str[-LENIENT_WINDOW_CHARS:])
        return found[-1] if found else None
    tail = solution_str[-WINDOW_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "") if found else None
    found = _FLEXIBLE.findall(tail)
    if not found:
        return None
    # The last run that is not a lone "."; when every run is one, veRL's loop ends on the first of them.
    return next((m for m in reversed(found) if m != "."), found[0])


def compute_score(
    solution_str: str, ground_truth: object, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if one was found but differs, else 0."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    if method == "lenient":
        correct = same_number(answer, ground_truth)
    else:
        correct = answer == (ground_truth if isinstance(ground_truth, str) else str(ground_truth))
    return score if correct else format_score
