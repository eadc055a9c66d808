"""reward_model.sandbox=true (issue 23, item 6): a custom reward function runs boxed - same scores for honest code,
no secrets, no network, a time limit - through the real scoring pool."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from hybridflow.rewards.custom import load_custom_reward_fn
from hybridflow.rewards.pool import ScoringPool
from hybridflow.rewards.registry import RewardConfigError
from hybridflow.rewards.sandboxed_custom import load_sandboxed_reward_fn
from hybridflow.trainer.config import ConfigError, load_config

FILE = str(Path(__file__).with_name("sandboxed_rewards.py"))


def _task(solution: str, truth: str) -> dict:
    return {"data_source": "t", "solution_str": solution, "ground_truth": truth, "extra_info": None}


def test_honest_function_scores_the_same_boxed_and_unboxed():
    tasks = [_task("42", "42"), _task(" 41", "42")]
    boxed = ScoringPool(load_sandboxed_reward_fn(FILE, "exact", time_limit_s=5), num_workers=1, timeout_s=20)
    plain = ScoringPool(load_custom_reward_fn(f"{FILE}:exact"), num_workers=1, timeout_s=20)
    try:
        a, b = boxed.score(tasks), plain.score(tasks)
    finally:
        boxed.close()
        plain.close()
    assert [(o.kind, o.score, o.extras) for o in a] == [(o.kind, o.score, o.extras) for o in b]
    assert [o.score for o in a] == [1.0, 0.0] and a[1].extras == {"length": 3.0}


def test_boxed_function_sees_no_secret_no_home_no_network_and_is_time_limited(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDFLOW_TEST_SECRET", "hunter2")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "planted.txt").write_text("the driver's home")
    server = socket.create_server(("127.0.0.1", 0))
    port = str(server.getsockname()[1])
    tasks = [_task("", "env"), _task("", "home"), _task(port, "socket"), _task("", "hang")]
    plain = ScoringPool(load_custom_reward_fn(f"{FILE}:snoop"), num_workers=1, timeout_s=20)
    boxed = ScoringPool(load_sandboxed_reward_fn(FILE, "snoop", time_limit_s=2), num_workers=1, timeout_s=20)
    try:
        unboxed = plain.score(tasks[:3])  # what the same code can do without the box
        out = boxed.score(tasks)
    finally:
        plain.close()
        boxed.close()
        server.close()
    assert [o.score for o in unboxed] == [1.0, 1.0, 1.0]
    assert out[0].kind == "ok" and out[0].score == 0.0  # no secret in its environment
    assert out[1].kind == "ok" and out[1].score == 0.0  # a scratch HOME, not the driver's
    assert out[2].kind == "raised" and ("not allowed" in out[2].message or "unreachable" in out[2].message
                                        or "Errno" in out[2].message), out[2].message
    assert out[3].kind == "raised" and "2 s limit" in out[3].message


def test_the_file_is_checked_without_being_imported(tmp_path):
    bad = tmp_path / "r.py"
    ran = str(tmp_path / "ran")
    bad.write_text(f"open({ran!r}, 'w').write('imported')\n\ndef score(data_source, solution_str):\n    return 1\n")
    with pytest.raises(RewardConfigError, match="missing \\['ground_truth', 'extra_info'\\]"):
        load_sandboxed_reward_fn(str(bad), "score", time_limit_s=1)
    with pytest.raises(RewardConfigError, match="no top-level function 'nope'"):
        load_sandboxed_reward_fn(str(bad), "nope", time_limit_s=1)
    assert not os.path.exists(tmp_path / "ran")


def test_sandbox_without_a_custom_function_is_a_config_error():
    with pytest.raises(ConfigError, match=r"reward_model\.sandbox=true boxes a custom reward function"):
        load_config(["reward_model.sandbox=true"])
