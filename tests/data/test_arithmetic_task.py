"""The built-in arithmetic task: files in veRL's schema, correct targets, disjoint splits, knobs, CLI."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from hybridflow.data import RLDataset
from hybridflow.data.tasks.arithmetic import ArithmeticConfig, generate_arithmetic_task, main
from hybridflow.engines.tiny import build_char_tokenizer
from hybridflow.rewards import default_compute_score


def _left_to_right(question: str) -> int:
    """Reference evaluation written independently of the generator: tokens split on operators."""
    import re

    tokens = re.findall(r"\d+|[+*-]", question)
    value = int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2]):
        value = value + int(num) if op == "+" else value - int(num) if op == "-" else value * int(num)
    return value


def test_generated_files_are_valid_and_targets_correct(tmp_path):
    train, val = generate_arithmetic_task(tmp_path, num_train=300, num_val=50, seed=0)
    train_rows, val_rows = pq.read_table(train).to_pylist(), pq.read_table(val).to_pylist()
    assert len(train_rows) == 300 and len(val_rows) == 50
    for row in train_rows + val_rows:
        q = row["extra_info"]["question"]
        assert row["data_source"] == "hybridflow/arithmetic"
        assert row["prompt"] == [{"role": "user", "content": q}] and len(q) < 40
        truth = row["reward_model"]["ground_truth"]
        assert int(truth) == _left_to_right(q) >= 0
        response = row["extra_info"]["response"]
        assert len(response) < 48 and response.endswith(f"#### {truth}")
        # Every worked line is a true equation.
        for line in response.split("\n")[:-1]:
            lhs, rhs = line.split("=")
            assert _left_to_right(lhs) == int(rhs)
        assert default_compute_score(row["data_source"], response, truth, row["extra_info"]) == 1.0
    val_questions = {r["extra_info"]["question"] for r in val_rows}
    assert len(val_questions) == 50
    assert not val_questions & {r["extra_info"]["question"] for r in train_rows}
    ds = RLDataset(val, build_char_tokenizer(), max_prompt_length=64)
    assert len(ds) == 50 and ds.stats["num_filtered_overlong"] == 0


def test_seed_determinism_and_knobs(tmp_path):
    a = generate_arithmetic_task(tmp_path / "a", num_train=20, num_val=5, seed=7)
    b = generate_arithmetic_task(tmp_path / "b", num_train=20, num_val=5, seed=7)
    c = generate_arithmetic_task(tmp_path / "c", num_train=20, num_val=5, seed=8)
    assert pq.read_table(a[0]).to_pylist() == pq.read_table(b[0]).to_pylist()
    assert pq.read_table(a[0]).to_pylist() != pq.read_table(c[0]).to_pylist()

    _, val = generate_arithmetic_task(
        tmp_path / "d", num_train=5, num_val=30, seed=0, min_operands=3, max_operands=3, min_digits=3, max_digits=3,
        operators="+", worked_solution=False, prompt_format="Add {question}",
    )
    for row in pq.read_table(val).to_pylist():
        q = row["extra_info"]["question"]
        nums = q.split("+")
        assert len(nums) == 3 and all(len(n) == 3 for n in nums)
        assert row["prompt"][0]["content"] == f"Add {q}"
        assert row["extra_info"]["response"] == f"#### {sum(map(int, nums))}"


def test_bad_options_and_small_space(tmp_path):
    with pytest.raises(TypeError, match="unknown arithmetic task option"):
        generate_arithmetic_task(tmp_path, num_train=1, num_val=1, max_digitz=3)
    with pytest.raises(ValueError, match="min_operands"):
        ArithmeticConfig(min_operands=1).validate()
    with pytest.raises(ValueError, match="too small"):  # 1-digit, 2 operands, '+': only 100 questions exist
        generate_arithmetic_task(tmp_path, num_train=1, num_val=101, max_operands=2, max_digits=1, operators="+")


def test_cli_main(tmp_path, capsys):
    assert main(["--out-dir", str(tmp_path), "--num-train", "10", "--num-val", "4", "--max-digits", "3"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "train.parquet") in out and str(tmp_path / "val.parquet") in out
    assert pq.read_table(tmp_path / "val.parquet").num_rows == 4
