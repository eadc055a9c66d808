"""Code problems: run the response's Python against stdin/stdout test cases in the sandbox.

ground_truth (a dict or its JSON string) is ``{"inputs": [str, ...], "outputs": [str, ...]}`` (the layout of
APPS / CodeContests / TACO-style preprocessed data) or a list of ``{"input": str, "output": str}``. The code is the last
fenced code block of the response (```` ```python ... ``` ````), or the whole response if it has none. Outputs are
compared line by line, ignoring trailing whitespace. Returns ``{"score": 1.0 if every case passes else 0.0,
"pass_rate": passed / total}``; function-call (``fn_name``) tests are not supported.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from hybridflow.rewards.sandbox import run_python_sandboxed

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(solution_str: str) -> str:
    blocks = _FENCE.findall(solution_str)
    return blocks[-1] if blocks else solution_str


def parse_test_cases(ground_truth: Any) -> list[tuple[str, str]]:
    if isinstance(ground_truth, str):
        ground_truth = json.loads(ground_truth)
    if isinstance(ground_truth, dict) and "inputs" in ground_truth and "outputs" in ground_truth:
        if "fn_name" in ground_truth:
            raise ValueError("code ground truth with 'fn_name' (function-call tests) is not supported; use stdin/stdout")
        cases = list(zip(ground_truth["inputs"], ground_truth["outputs"]))
    elif isinstance(ground_truth, list) and all(isinstance(c, dict) and "input" in c and "output" in c for c in ground_truth):
        cases = [(c["input"], c["output"]) for c in ground_truth]
    else:
        raise ValueError(
            "code ground truth must be {'inputs': [...], 'outputs': [...]} or [{'input': ..., 'output': ...}], "
            f"got {str(ground_truth)[:80]!r}"
        )
    if not cases:
        raise ValueError("code ground truth has no test cases")
    return [(str(i), str(o)) for i, o in cases]


def _same_output(actual: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.strip("\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(actual) == lines(expected)


def compute_score(
    solution_str: str,
    ground_truth: Any,
    time_limit_s: float = 2.0,
    memory_limit_mb: int = 512,
    max_cases: int = 16,
    total_time_limit_s: float = 8.0,
    runner: Any = None,
) -> dict[str, float]:
    """Cases stop once `total_time_limit_s` is spent (the rest count as failed), which keeps one sample inside the
    reward manager's default per-sample timeout (10 s). `runner` runs one case (default: the local box,
    `run_python_sandboxed`; rewards/sandbox_fusion.py's RemoteRunner sends it to a SandboxFusion service)."""
    runner = run_python_sandboxed if runner is None else runner
    cases = parse_test_cases(ground_truth)[:max_cases]
    code = extract_code(solution_str)
    passed = 0
    deadline = time.monotonic() + total_time_limit_s
    for stdin, expected in cases:
        if time.monotonic() >= deadline:
            break
        result = runner(code, stdin, time_limit_s=time_limit_s, memory_limit_mb=memory_limit_mb)
        if result.ok and _same_output(result.stdout, expected):
            passed += 1
        elif result.timed_out or result.memory_exceeded:
            break  # the remaining cases would most likely fail the same way; do not spend their time
    return {"score": 1.0 if passed == len(cases) else 0.0, "pass_rate": passed / len(cases)}
