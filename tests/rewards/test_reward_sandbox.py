"""The sandbox stops runaway, memory-hungry and networking code; the code scorer scores such responses as failures."""

from __future__ import annotations

import json
import time

import pytest
import torch

from hybridflow.engines.tiny import build_char_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardManager
from hybridflow.rewards.sandbox import network_isolation_available, run_python_sandboxed
from hybridflow.rewards.scorers import code


def test_runs_code_with_stdin_in_a_scratch_directory():
    result = run_python_sandboxed("import os\nprint(input()[::-1])\nprint(os.listdir('.'))", "hello\n")
    assert result.ok and result.returncode == 0 and not result.timed_out
    lines = result.stdout.splitlines()
    assert lines[0] == "olleh"
    assert "solution.py" in lines[1] and ".venv" not in lines[1]  # a fresh scratch dir, not the repo


def test_infinite_loop_is_killed_at_the_time_limit():
    start = time.monotonic()
    result = run_python_sandboxed("while True:\n    pass\n", time_limit_s=1.0)
    assert result.timed_out and not result.ok and result.returncode is None
    assert time.monotonic() - start < 10


def test_huge_allocation_fails():
    result = run_python_sandboxed("x = bytearray(4 * 1024**3)\nprint('allocated')", memory_limit_mb=256)
    assert not result.ok and result.memory_exceeded and "allocated" not in result.stdout


def test_opening_a_socket_fails():
    script = "import socket\ns = socket.create_connection(('127.0.0.1', 80), timeout=1)\nprint('connected')"
    result = run_python_sandboxed(script)
    assert not result.ok and "connected" not in result.stdout
    assert "PermissionError" in result.stderr or "OSError" in result.stderr
    assert result.network_isolation == ("netns" if network_isolation_available() else "audit-hook")


def test_spawning_processes_and_raising_limits_fail():
    assert "PermissionError" in run_python_sandboxed("import subprocess\nsubprocess.run(['true'])").stderr
    raised = run_python_sandboxed("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\nprint('raised')")
    assert not raised.ok and "raised" not in raised.stdout


def test_output_is_capped():
    result = run_python_sandboxed("print('x' * 100000)", max_output_bytes=1000)
    assert result.output_truncated and len(result.stdout) <= 1000


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_code_scorer_through_the_manager_scores_bad_code_as_failure(tokenizer):
    tests = json.dumps({"inputs": ["2 3\n", "10 5\n"], "outputs": ["5\n", "15\n"]})
    responses = [
        "```python\na, b = map(int, input().split())\nprint(a + b)\n```",  # correct
        "```python\nprint(5)\n```",  # passes 1 of 2
        "```python\nwhile True:\n    pass\n```",
        "```python\nx = bytearray(8 * 1024**3)\n```",
        "```python\nimport socket\nsocket.create_connection(('1.1.1.1', 80))\n```",
    ]
    encoded = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(map(len, encoded))
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(encoded):
        ids[i, : len(e)], mask[i, : len(e)] = torch.tensor(e), 1
    batch = DataProto.from_dict(
        {"responses": ids, "response_mask": mask}, {"data_source": ["code"] * 5, "ground_truth": [tests] * 5}
    )
    with RewardManager(tokenizer, num_workers=2, timeout_s=30) as rm:
        result = rm(batch)
    assert result.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.extra["pass_rate"] == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert result.metrics["reward/failures"] == 0  # bad code is a wrong answer, not a scorer failure


def test_code_ground_truth_formats():
    cases = [{"input": "1\n", "output": "2"}]
    assert code.compute_score("print(int(input()) + 1)", cases)["score"] == 1.0
    with pytest.raises(ValueError, match="fn_name"):
        code.parse_test_cases({"inputs": [], "outputs": [], "fn_name": "f"})
    with pytest.raises(ValueError, match="must be"):
        code.parse_test_cases("[1, 2]")
