r"""Competition-math final answers: the content of the last ``\boxed{...}`` compared with the ground truth.

Equivalence is decided in three steps, cheapest first:
  1. both sides normalised as text (spaces, ``\left``/``\right``, ``\dfrac`` -> ``\frac``, ``\text{...}``, degrees,
     ``%``, a leading ``x =``, thousands separators, trailing zeros) and compared;
  2. both read as exact rationals (``3``, ``-0.25``, ``\frac{1}{4}``, ``1/4``) and compared;
  3. if the optional ``math-verify`` package is installed (``pip install hybridflow[math]``), its symbolic check
     (``\sqrt{8}`` vs ``2\sqrt{2}``, intervals, sets). Without it, step 3 is skipped.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED_COMMANDS = ("\\boxed", "\\fbox")
_MAX_ANSWER_CHARS = 500


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` (nested braces balanced), or of ``\boxed 5``."""
    start = max(text.rfind(cmd) for cmd in _BOXED_COMMANDS)
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed") :] if rest.startswith("\\boxed") else rest[len("\\fbox") :]
    body = rest.lstrip()
    if not body.startswith("{"):  # "\boxed 5": the answer is the next word
        return body.split("$", 1)[0].split()[0] if rest.startswith(" ") and body.strip("$ ") else None
    rest = body
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: the answer was cut off


def _strip_braced_command(s: str, command: str) -> str:
    r"""``\text{abc}`` -> ``abc`` for every occurrence (innermost braces balanced)."""
    out, i = [], 0
    while True:
        j = s.find(command + "{", i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j])
        k, depth = j + len(command), 0
        while k < len(s):
            if s[k] == "{":
                depth += 1
            elif s[k] == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        out.append(s[j + len(command) + 1 : k])
        i = k + 1


def normalize(answer: str) -> str:
    """A canonical text form of a final answer."""
    s = answer.strip()
    for command in ("\\text", "\\textbf", "\\mathrm", "\\mbox"):
        s = _strip_braced_command(s, command)
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""),
                     ("^{\\circ}", ""), ("^\\circ", ""), ("\\%", ""), ("%", ""), ("\\$", ""), ("$", ""),
                     ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""), ("\\displaystyle", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"^[a-zA-Z]=", "", s)  # "x=5" -> "5"
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".")
    return s


def as_rational(s: str) -> Fraction | None:
    r"""'3', '-0.25', '\frac{1}{4}', '-\frac{1}{4}', '1/4' -> Fraction; None otherwise."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?)(-?\d+)/(-?\d+)", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s) and len(s) < 100:
            return Fraction(s)
    except (ZeroDivisionError, ValueError):
        return None
    return None


def is_equivalent(prediction: str, ground_truth: str, use_math_verify: bool = True) -> bool:
    a, b = normalize(prediction), normalize(ground_truth)
    if not a:
        return False
    if a == b:
        return True
    x, y = as_rational(a), as_rational(b)
    if x is not None and y is not None:
        return x == y
    if use_math_verify:
        return _math_verify_equal(prediction, ground_truth)
    return False


def _math_verify_equal(prediction: str, ground_truth: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    try:
        # Timeouts are the reward manager's job (it kills a stuck worker); math-verify's own use signals.
        gold = parse(f"${ground_truth}$", parsing_timeout=None)
        pred = parse(f"${prediction}$", parsing_timeout=None)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=None))
    except Exception:  # math-verify raises on malformed latex in some versions; a malformed answer is just wrong
        return False


def compute_score(solution_str: str, ground_truth: object, use_math_verify: bool = True) -> float:
    """1.0 if the last boxed answer is equivalent to `ground_truth` (a string, possibly itself boxed), else 0.0."""
    answer = last_boxed(solution_str)
    if answer is None or len(answer) > _MAX_ANSWER_CHARS:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return 1.0 if is_equivalent(answer, truth, use_math_verify) else 0.0
