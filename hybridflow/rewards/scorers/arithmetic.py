"""The built-in arithmetic task (data_source ``hybridflow/arithmetic``): exact match of the last ``#### <integer>``.

A response scores 1.0 when the text after its last ``####`` (up to the end of that line) is exactly one integer equal
to the ground truth, ``format_score`` (default 0) when it is an integer that differs, and 0 otherwise.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)


def extract_answer(solution_str: str) -> str | None:
    marker = solution_str.rfind("####")
    if marker < 0:
        return None
    answer = solution_str[marker + 4 :].split("\n", 1)[0].strip()
    return answer if _INTEGER.fullmatch(answer) else None


def _canonical(integer: str) -> str:
    sign = "-" if integer.startswith("-") else ""
    digits = integer.lstrip("+-").lstrip("0") or "0"
    return digits if digits == "0" else sign + digits  # "-0" == "0"


def compute_score(solution_str: str, ground_truth: object, format_score: float = 0.0) -> float:
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth).strip()
    if not _INTEGER.fullmatch(truth):
        raise ValueError(f"hybridflow/arithmetic ground truth must be an integer, got {ground_truth!r}")
    return 1.0 if _canonical(answer) == _canonical(truth) else format_score
