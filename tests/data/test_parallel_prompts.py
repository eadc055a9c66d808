"""veRL's data.filter_overlong_prompts_workers: prompts rendered and tokenized in worker processes give the same
dataset as the serial path, row for row (overlong rows filtered or truncated alike), and a template error still
names the file and row."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data import DataConfigError, RLDataset
from hybridflow.data.parallel_prompts import PARALLEL_MIN_ROWS
from hybridflow.engines.tiny import build_char_tokenizer


def rows(n: int) -> list[dict]:
    out = []
    for i in range(n):
        question = f"What is {i} + {i * 7 % 13}?" + " and more" * (i % 9)  # lengths vary; some rows are overlong
        out.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}],
                    "reward_model": {"style": "rule", "ground_truth": str(i)}})
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows(PARALLEL_MIN_ROWS + 37)), path)
    return str(path)


@pytest.mark.parametrize("filter_overlong", [True, False], ids=["filtered", "truncated-left"])
def test_two_worker_processes_give_the_serial_dataset(data_file, filter_overlong):
    tok = build_char_tokenizer()
    kwargs = dict(max_prompt_length=60, filter_overlong_prompts=filter_overlong, truncation="left")
    serial = RLDataset(data_file, tok, **kwargs)
    parallel = RLDataset(data_file, tok, num_workers=2, **kwargs)
    assert serial.stats["num_prompt_workers"] == 1 and parallel.stats["num_prompt_workers"] == 2
    assert {k: v for k, v in serial.stats.items() if k != "num_prompt_workers"} == {
        k: v for k, v in parallel.stats.items() if k != "num_prompt_workers"}
    assert serial.stats["num_filtered_overlong" if filter_overlong else "num_truncated"] > 0
    assert len(serial) == len(parallel)
    for i in range(len(serial)):
        a, b = serial[i], parallel[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and a["ground_truth"] == b["ground_truth"]


def test_small_files_stay_in_process_and_errors_name_the_row(tmp_path):
    tok = build_char_tokenizer()
    path = tmp_path / "small.parquet"
    pq.write_table(pa.Table.from_pylist(rows(20)), path)
    assert RLDataset(str(path), tok, max_prompt_length=200, num_workers=4).stats["num_prompt_workers"] == 1
    with pytest.raises(DataConfigError, match=r"filter_overlong_prompts_workers=0 must be >= 1"):
        RLDataset(str(path), tok, num_workers=0)


def test_the_work_is_done_in_other_processes(data_file):
    from hybridflow.data.parallel_prompts import PromptWork

    chats = [r["prompt"] for r in rows(PARALLEL_MIN_ROWS)]
    origins = [(data_file, i) for i in range(len(chats))]
    with PromptWork(build_char_tokenizer(), len(chats), 2, True, {}) as work:
        texts = work.render(chats, origins)
    assert work.pids and os.getpid() not in work.pids and len(texts) == len(chats)


def test_a_template_error_in_a_worker_names_file_and_row(data_file, tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = "{% if messages[0]['content'].startswith('What is 1017 ') %}{{ raise_exception('no') }}" \
                        "{% endif %}{{ messages[0]['content'] }}"
    with pytest.raises(DataConfigError, match=rf"data file '{data_file}', row 1017: the chat template failed"):
        RLDataset(data_file, tok, max_prompt_length=500, num_workers=2)
    assert os.path.exists(data_file)
