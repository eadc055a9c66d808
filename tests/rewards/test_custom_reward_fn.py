"""load_custom_reward_fn: 'path/to/file.py:function_name', with clear errors for each way it can be wrong."""

from __future__ import annotations

import os
import pickle

import pytest

from hybridflow.rewards import RewardConfigError, load_custom_reward_fn

FNS = os.path.join(os.path.dirname(__file__), "custom_reward_fns.py")


def test_loads_and_calls_and_pickles():
    fn = load_custom_reward_fn(f"{FNS}:exact")
    assert fn("any", "42 ", "42") == 1.0 and fn("any", "41", "42", extra_info={"a": 1}) == 0.0
    clone = pickle.loads(pickle.dumps(fn))  # what worker processes receive
    assert clone("any", "42", "42") == 1.0 and clone.path == fn.path
    assert load_custom_reward_fn(f"{FNS}:kwargs_only")("d", "x", "x") == 1.0
    assert load_custom_reward_fn(FNS, "exact")("d", "x", "x") == 1.0


def test_missing_file(tmp_path):
    with pytest.raises(RewardConfigError, match=r"nope\.py' does not exist"):
        load_custom_reward_fn(f"{tmp_path}/nope.py:fn")


def test_missing_function_lists_the_ones_there():
    with pytest.raises(RewardConfigError, match=r"has no function 'compute_score'.*'exact'"):
        load_custom_reward_fn(f"{FNS}:compute_score")


def test_wrong_signature():
    with pytest.raises(RewardConfigError, match=r"must accept \(data_source, solution_str, ground_truth, extra_info"):
        load_custom_reward_fn(f"{FNS}:wrong_signature")


def test_not_callable():
    with pytest.raises(RewardConfigError, match="NOT_A_FUNCTION is a int, not a function"):
        load_custom_reward_fn(f"{FNS}:NOT_A_FUNCTION")


def test_malformed_spec_and_broken_file(tmp_path):
    with pytest.raises(RewardConfigError, match=r"'path/to/file\.py:function_name'"):
        load_custom_reward_fn(FNS)
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardConfigError, match=r"failed to import: ModuleNotFoundError"):
        load_custom_reward_fn(f"{broken}:fn")
