"""Rule scorers on ordinary and adversarial responses, and dispatch by data_source."""

from __future__ import annotations

import json

import pytest

from hybridflow.rewards import RewardConfigError, available_scorers, default_compute_score, register_scorer
from hybridflow.rewards.scorers import arithmetic, countdown, gsm8k, math_answer


@pytest.mark.parametrize(
    ("response", "truth", "strict", "flexible"),
    [
        ("3 + 4 = 7\n#### 7", "7", 1.0, 1.0),
        ("#### 7\nwait, no\n#### 8", "8", 1.0, 1.0),  # the last #### counts
        ("#### 8\n#### 7", "8", 0.0, 0.0),
        ("#### $1,000.", "1000", 1.0, 1.0),  # $, thousands commas, trailing period
        ("#### 1,000", "1,000", 1.0, 1.0),
        ("#### -3.50", "-3.5", 1.0, 1.0),
        ("the answer is 72", "72", 0.0, 1.0),  # no marker: only flexible finds it
        ("", "72", 0.0, 0.0),
        ("#### ٧٢", "72", 0.0, 0.0),  # Arabic-Indic digits are not read as 72
        ("#### ７２", "72", 0.0, 0.0),  # nor fullwidth digits
        ("#### " + "9" * 300, "9" * 300, 1.0, 1.0),  # exact, far beyond float precision
        ("#### " + "9" * 299 + "8", "9" * 300, 0.0, 0.0),
        ("#### " + "9" * 5000, "9" * 5000, 0.0, 0.0),  # absurdly long: refused quickly, no crash
        ("#### 72abc", "72", 1.0, 1.0),
        ("#### 7.2e5", "720000", 0.0, 0.0),
    ],
)
def test_gsm8k(response, truth, strict, flexible):
    assert gsm8k.compute_score(response, truth) == strict
    assert gsm8k.compute_score(response, truth, method="flexible") == flexible


def test_gsm8k_format_score_and_dispatch():
    assert gsm8k.compute_score("#### 5", "6", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "6", format_score=0.1) == 0.0
    assert default_compute_score("openai/gsm8k", "#### 6", "6") == 1.0
    assert default_compute_score("gsm8k", "#### 6", "6") == 1.0


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        (r"so \boxed{42}", "42", 1.0),
        (r"\boxed{41} then \boxed{42}", "42", 1.0),  # the last box counts
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac12}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),  # nested braces
        (r"\boxed{x = 5}", "5", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{\text{(B)}}", "(B)", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{2.50}", "2.5", 1.0),
        (r"\fbox{7}", "7", 1.0),
        (r"\boxed {7}", "7", 1.0),
        (r"$\boxed 7$.", "7", 1.0),
        (r"ends with \boxed", "7", 0.0),
        (r"\boxed{\frac{1}{2}", "0.5", 0.0),  # unbalanced: cut off
        ("42", "42", 0.0),  # no box
        (r"\boxed{}", "42", 0.0),
        (r"\boxed{43}", "42", 0.0),
        (r"\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}", "1", 0.0),  # deep nesting: refused, no crash
    ],
)
def test_math(response, truth, expected):
    assert math_answer.compute_score(response, truth, use_math_verify=False) == expected


def test_math_symbolic_with_math_verify():
    pytest.importorskip("math_verify", reason="optional symbolic equivalence (pip install math-verify)")
    assert math_answer.compute_score(r"\boxed{2\sqrt{2}}", r"\sqrt{8}") == 1.0
    assert math_answer.compute_score(r"\boxed{2\sqrt{3}}", r"\sqrt{8}") == 0.0
    assert default_compute_score("lighteval/MATH", r"\boxed{\frac{2}{4}}", r"\frac{1}{2}") == 1.0


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<answer>(25 - 3) * 2 + 7</answer>", 1.0),
        ("<answer>(25-3)*2+7 = 51</answer>", 1.0),
        ("<answer>1+1</answer> no wait <answer>7 + (25-3)*2</answer>", 1.0),
        ("#### 2*(25-3)+7", 1.0),
        ("<answer>(25 - 3) * 2 + 7 + 0</answer>", 0.1),  # a number not given
        ("<answer>25 * 2 + 3 - 2</answer>", 0.1),  # 2 used twice, 7 unused
        ("<answer>25 * 2 + 2 - 7 + 3 + 3</answer>", 0.1),  # numbers used twice
        ("<answer>(25 - 3) * 2</answer>", 0.1),  # 7 unused
        ("<answer>25 / (3 - 3) + 2 + 7</answer>", 0.1),  # division by zero
        ("<answer>__import__('os')</answer>", 0.0),  # not an equation at all
        ("<answer>2**25 + 3 + 7</answer>", 0.1),  # power is not an allowed operation
        ("no answer", 0.0),
    ],
)
def test_countdown(response, expected):
    truth = {"target": 51, "numbers": [25, 3, 2, 7]}
    assert countdown.compute_score(response, truth) == expected
    assert countdown.compute_score(response, json.dumps(truth)) == expected  # ground truth stored as JSON text


def test_countdown_fractions_and_subset():
    truth = {"target": 3, "numbers": [7, 2, 1]}
    assert countdown.compute_score("<answer>(7 - 1) / 2</answer>", truth) == 1.0
    assert countdown.compute_score("<answer>7 / 2 - 1</answer>", truth) == 0.1  # 2.5, exact arithmetic
    assert countdown.compute_score("<answer>2 + 1</answer>", truth, use_all_numbers=False) == 1.0
    with pytest.raises(ValueError, match="countdown ground truth"):
        countdown.compute_score("<answer>1</answer>", "51")


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("12+35=47\n47+7=54\n#### 54", 1.0),
        ("#### 54", 1.0),
        ("#### 054", 1.0),
        ("#### +54", 1.0),
        ("#### 54 \n", 1.0),
        ("#### 53\n#### 54", 1.0),  # the last #### counts
        ("#### 54\n#### 53", 0.0),
        ("#### 54.0", 0.0),
        ("#### 54 apples", 0.0),
        ("#### ٥٤", 0.0),  # unicode digits
        ("54", 0.0),
        ("", 0.0),
        ("#### " + "5" * 10000, 0.0),  # huge number, no crash
        ("####", 0.0),
    ],
)
def test_arithmetic(response, expected):
    assert arithmetic.compute_score(response, "54") == expected
    assert default_compute_score("hybridflow/arithmetic", response, "54") == expected


def test_arithmetic_negative_zero_and_format_score():
    assert arithmetic.compute_score("#### -0", "0") == 1.0
    assert arithmetic.compute_score("#### -7", "-7") == 1.0
    assert arithmetic.compute_score("#### 7", "-7") == 0.0
    assert arithmetic.compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert arithmetic.compute_score("8", "7", format_score=0.1) == 0.0


def test_unknown_data_source_lists_known_ones_and_how_to_add():
    with pytest.raises(RewardConfigError) as e:
        default_compute_score("my/new-task", "x", "y")
    msg = str(e.value)
    assert "'my/new-task'" in msg and "openai/gsm8k" in msg and "custom_reward_function" in msg
    assert "register_scorer" in msg


def test_register_scorer():
    from custom_reward_fns import exact

    register_scorer("tests/exact", exact)
    assert "tests/exact" in available_scorers()
    assert default_compute_score("tests/exact", " a ", "a") == 1.0
    with pytest.raises(RewardConfigError, match="registered already"):
        register_scorer("tests/exact", exact)
    register_scorer("tests/exact", exact, override=True)  # replacing is explicit
    with pytest.raises(RewardConfigError, match="cannot be pickled"):
        register_scorer("tests/lambda", lambda *a: 1.0)
