"""RLDataset: veRL-schema parquet/JSONL read as-is, chat template applied, overlong handling, bad input named."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data import DataConfigError, RLDataset
from hybridflow.engines.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def verl_row(question: str, answer: str = "42", index: int = 0, source: str = "openai/gsm8k") -> dict:
    """A row exactly as veRL's gsm8k preprocessing writes it."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index, "answer": f"#### {answer}", "question": question},
    }


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_parquet_and_jsonl_read_as_is_with_chat_template(tmp_path, tokenizer):
    rows = [verl_row(f"What is {i}+{i}?", str(2 * i), i) for i in range(5)]
    for path in (write_parquet(tmp_path / "d.parquet", rows), write_jsonl(tmp_path / "d.jsonl", rows)):
        ds = RLDataset(path, tokenizer, max_prompt_length=128)
        assert len(ds) == 5 and ds.stats["num_rows"] == 5 and ds.stats["num_filtered_overlong"] == 0
        item = ds[3]
        expected = tokenizer.apply_chat_template(rows[3]["prompt"], add_generation_prompt=True, tokenize=False)
        assert expected.endswith("<|im_start|>assistant\n") and "What is 3+3?" in expected
        assert tokenizer.decode(item["input_ids"]) == expected
        assert item["attention_mask"].tolist() == [1] * len(item["input_ids"])
        assert item["raw_prompt"] == rows[3]["prompt"]
        assert item["ground_truth"] == "6" and item["reward_model"] == {"style": "rule", "ground_truth": "6"}
        assert item["extra_info"] == rows[3]["extra_info"] and item["data_source"] == "openai/gsm8k"
        assert item["ability"] == "math" and item["index"] == 3


def test_several_files_concatenate_and_duplicates_are_counted(tmp_path, tokenizer):
    a = write_parquet(tmp_path / "a.parquet", [verl_row("q1"), verl_row("q2")])
    b = write_jsonl(tmp_path / "b.jsonl", [verl_row("q2"), verl_row("q3"), verl_row("q1")])
    ds = RLDataset([a, b], tokenizer)
    assert len(ds) == 5
    assert ds.stats["num_duplicate_prompts"] == 2
    assert [ds[i]["raw_prompt"][0]["content"] for i in range(5)] == ["q1", "q2", "q2", "q3", "q1"]


def test_overlong_prompts_filtered_counted_and_logged(tmp_path, tokenizer, caplog):
    rows = [verl_row("short"), verl_row("x" * 200), verl_row("also short"), verl_row("y" * 300)]
    path = write_parquet(tmp_path / "d.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        ds = RLDataset(path, tokenizer, max_prompt_length=64)
    assert len(ds) == 2 and ds.stats["num_filtered_overlong"] == 2 and ds.stats["num_rows_read"] == 4
    assert [ds[i]["raw_prompt"][0]["content"] for i in range(2)] == ["short", "also short"]
    assert any("filtered 2 of 4" in r.getMessage() for r in caplog.records)


def test_truncation_left_right_error(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "d.parquet", [verl_row("abcdefghij" * 5), verl_row("hi")])
    full = RLDataset(path, tokenizer, max_prompt_length=1000)[0]["input_ids"]
    left = RLDataset(path, tokenizer, max_prompt_length=40, filter_overlong_prompts=False, truncation="left")
    right = RLDataset(path, tokenizer, max_prompt_length=40, filter_overlong_prompts=False, truncation="right")
    assert left[0]["input_ids"].tolist() == full[-40:].tolist()
    assert right[0]["input_ids"].tolist() == full[:40].tolist()
    assert left.stats["num_truncated"] == 1 and len(left) == 2
    with pytest.raises(DataConfigError, match=r"row 0.*longer than max_prompt_length=40"):
        RLDataset(path, tokenizer, max_prompt_length=40, filter_overlong_prompts=False, truncation="error")
    with pytest.raises(DataConfigError, match="truncation='middle' is not one of"):
        RLDataset(path, tokenizer, truncation="middle")


def test_all_filtered_is_an_error(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "d.parquet", [verl_row("x" * 100)])
    with pytest.raises(DataConfigError, match="all 1 prompts are longer"):
        RLDataset(path, tokenizer, max_prompt_length=10)


def test_without_chat_template_when_disabled(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "d.parquet", [verl_row("plain text")])
    ds = RLDataset(path, build_char_tokenizer(chat_template=None), apply_chat_template=False)
    assert tokenizer.decode(ds[0]["input_ids"]) == "plain text"


# ---------------------------------------------------------------- bad input: each names the problem


def test_missing_file(tmp_path, tokenizer):
    with pytest.raises(DataConfigError, match=r"nope\.parquet.*does not exist"):
        RLDataset(str(tmp_path / "nope.parquet"), tokenizer)


def test_unknown_extension(tmp_path, tokenizer):
    p = tmp_path / "d.csv"
    p.write_text("a,b\n")
    with pytest.raises(DataConfigError, match=r"unknown extension '\.csv'"):
        RLDataset(str(p), tokenizer)


def test_missing_column(tmp_path, tokenizer):
    rows = [{k: v for k, v in verl_row("q").items() if k != "prompt"}]
    path = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(DataConfigError, match=r"no column\(s\) \['prompt'\]"):
        RLDataset(path, tokenizer)
    with pytest.raises(DataConfigError, match=r"no column\(s\) \['question'\]"):
        RLDataset(path, tokenizer, prompt_key="question")


def test_wrong_column_type_prompt_string(tmp_path, tokenizer):
    row = verl_row("q")
    row["prompt"] = "just a string"
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("ok"), row])
    with pytest.raises(DataConfigError, match=r"row 1, column 'prompt'.*plain string"):
        RLDataset(path, tokenizer)


def test_wrong_column_type_data_source_and_messages(tmp_path, tokenizer):
    row = verl_row("q")
    row["data_source"] = 7
    with pytest.raises(DataConfigError, match=r"row 0, column 'data_source'.*int 7"):
        RLDataset(write_jsonl(tmp_path / "a.jsonl", [row]), tokenizer)
    row = verl_row("q")
    row["prompt"] = [{"role": "user", "text": "q"}]
    with pytest.raises(DataConfigError, match=r"message 0: expected a dict with 'role' and 'content'"):
        RLDataset(write_jsonl(tmp_path / "b.jsonl", [row]), tokenizer)
    row = verl_row("q")
    row["reward_model"] = "42"
    with pytest.raises(DataConfigError, match=r"column 'reward_model': expected a dict"):
        RLDataset(write_jsonl(tmp_path / "c.jsonl", [row]), tokenizer)


def test_empty_prompt(tmp_path, tokenizer):
    for i, prompt in enumerate(([], [{"role": "user", "content": "   "}])):
        row = verl_row("q")
        row["prompt"] = prompt
        with pytest.raises(DataConfigError, match=r"row 0, column 'prompt': the prompt is empty"):
            RLDataset(write_jsonl(tmp_path / f"d{i}.jsonl", [row]), tokenizer)


def test_non_utf8_bytes(tmp_path, tokenizer):
    good = json.dumps(verl_row("fine")).encode()
    bad = json.dumps(verl_row("caf_")).encode().replace(b"caf_", b"caf\xe9")
    p = tmp_path / "d.jsonl"
    p.write_bytes(good + b"\n" + bad + b"\n")
    with pytest.raises(DataConfigError, match=r"line 2 \(row 1\).*not valid UTF-8"):
        RLDataset(str(p), tokenizer)
    # Parquet with a binary prompt content column holding invalid UTF-8.
    table = pa.table({
        "data_source": ["openai/gsm8k"],
        "prompt": pa.array([[{"role": "user", "content": b"caf\xe9"}]],
                           type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.binary())]))),
        "reward_model": [{"style": "rule", "ground_truth": "1"}],
    })
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(DataConfigError, match=r"row 0, column 'prompt\[0\]\.content'.*not valid UTF-8"):
        RLDataset(str(tmp_path / "d.parquet"), tokenizer)


def test_invalid_json_line(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(verl_row("a")) + "\n{not json\n")
    with pytest.raises(DataConfigError, match=r"line 2 \(row 1\): not valid JSON"):
        RLDataset(str(p), tokenizer)


def test_tokenizer_without_chat_template(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [verl_row("q")])
    with pytest.raises(DataConfigError, match=r"no chat template.*apply_chat_template=False"):
        RLDataset(path, build_char_tokenizer(chat_template=None))


def test_tokenizer_without_pad_token(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [verl_row("q")])
    tok = build_char_tokenizer()
    tok.pad_token = None
    with pytest.raises(DataConfigError, match=r"no pad token.*tokenizer\.pad_token = tokenizer\.eos_token"):
        RLDataset(path, tok)


def test_missing_ground_truth(tmp_path, tokenizer):
    row = verl_row("q")
    row["reward_model"] = {"style": "rule", "ground_truth": None}
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("a"), verl_row("b"), row])
    with pytest.raises(DataConfigError, match=r"row 2, column 'reward_model': no ground truth"):
        RLDataset(path, tokenizer)
    row = {k: v for k, v in verl_row("q").items() if k != "reward_model"}
    path = write_jsonl(tmp_path / "e.jsonl", [row])
    with pytest.raises(DataConfigError, match="no ground truth"):
        RLDataset(path, tokenizer)
    assert RLDataset(path, tokenizer, require_ground_truth=False)[0]["ground_truth"] is None


def test_ground_truth_given_twice(tmp_path, tokenizer):
    same, top_only, conflicting = verl_row("a", "1"), verl_row("b", "2"), verl_row("c", "3")
    same["ground_truth"] = "1"
    top_only["ground_truth"] = "2"
    del top_only["reward_model"]
    ds = RLDataset(write_jsonl(tmp_path / "ok.jsonl", [same, top_only]), tokenizer)
    assert [ds[0]["ground_truth"], ds[1]["ground_truth"]] == ["1", "2"]
    conflicting["ground_truth"] = "4"
    with pytest.raises(DataConfigError, match=r"row 0, column 'ground_truth': two different ground truths"):
        RLDataset(write_jsonl(tmp_path / "bad.jsonl", [conflicting]), tokenizer)
