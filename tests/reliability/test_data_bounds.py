"""Bounded memory on bad data and counts people see (issue 23, item 5): a huge prompt is judged on its character count
before tokenizing; filtered and duplicate prompts are counted in metrics.jsonl and printed on the console."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.data import RLDataset
from hybridflow.engines.tiny import build_char_tokenizer
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training


def _row(question: str) -> dict:
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": 0}}


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


_PROBE = """
import json, resource, sys
from hybridflow.data import RLDataset
from hybridflow.engines.tiny import build_char_tokenizer
tok = build_char_tokenizer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ds = RLDataset(sys.argv[1], tok, max_prompt_length=512)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"delta_mb": (after - before) / 1024, "stats": ds.stats}))
"""


def test_a_10mb_prompt_costs_its_own_size_not_its_tokenization(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [_row("what is 1+0?"), _row("x" * 10_000_000)])
    out = subprocess.run([sys.executable, "-c", _PROBE, path], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["stats"]["num_filtered_overlong"] == 1 and result["stats"]["num_filtered_by_length_bound"] == 1
    # Tokenizing the row whole peaked at ~1.9 GB above the baseline; its own text (read, templated) is ~30 MB.
    assert result["delta_mb"] < 300, result


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncating_a_long_prompt_keeps_the_same_tokens_as_tokenizing_it_whole(tmp_path, truncation):
    tok = build_char_tokenizer()
    long_q = "".join(f"{i} plus {i} is {2 * i}; " for i in range(2000))  # ~40k characters, far over the bound
    path = _write_jsonl(tmp_path / "d.jsonl", [_row("short"), _row(long_q)])
    ds = RLDataset(path, tok, max_prompt_length=32, filter_overlong_prompts=False, truncation=truncation)
    assert len(long_q) > (32 + 2) * ds.chars_per_token  # the cheap path was taken
    text = tok.apply_chat_template(_row(long_q)["prompt"], add_generation_prompt=True, tokenize=False)
    full = tok(text, add_special_tokens=False)["input_ids"]
    expected = full[-32:] if truncation == "left" else full[:32]
    assert ds[1]["input_ids"].tolist() == expected and ds.stats["num_truncated"] == 1


def test_a_long_prompt_with_truncation_error_names_the_row_without_tokenizing(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [_row("short"), _row("y" * 100_000)])
    with pytest.raises(ValueError, match=r"d\.jsonl', row 1, column 'prompt': the prompt is \d+ characters"):
        RLDataset(path, build_char_tokenizer(), max_prompt_length=32, filter_overlong_prompts=False)


def test_filtered_and_duplicate_counts_reach_metrics_and_the_console(arithmetic_files, tiny_model_path, tmp_path,
                                                                      capsys):
    train, val = arithmetic_files
    rows = pq.read_table(train).to_pylist()
    rows += [rows[0], rows[1], {**rows[2], "prompt": [{"role": "user", "content": "z" * 5000}]}]
    bad_train = tmp_path / "train.parquet"
    pq.write_table(pq.read_table(train).from_pylist(rows, schema=pq.read_table(train).schema), bad_train)
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides((str(bad_train), val), tiny_model_path, run_dir, "trainer.backend=local",
                                         "trainer.total_training_steps=1"))
    run_training(cfg, progress=False)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        row = json.loads(f.readline())
    dups = RLDataset(train, build_char_tokenizer(), max_prompt_length=32).stats["num_duplicate_prompts"] + 2
    assert row["data/train_filtered_overlong"] == 1 and row["data/train_duplicate_prompts"] == dups
    assert row["data/train_rows"] == 130 and row["data/val_rows"] == 16
    out = capsys.readouterr().out
    assert "train data: 130 of 131 prompts kept; 1 filtered as longer than max_prompt_length=32 tokens" in out
    assert f"{dups} duplicates kept" in out
