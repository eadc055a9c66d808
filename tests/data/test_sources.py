"""Prompt sources by name: reasoning-gym tasks (veRL's schema, scored by the task's own score_answer) and Hugging Face
`datasets` folders written with save_to_disk."""

from __future__ import annotations

import pytest
import torch

from hybridflow.data import DataConfigError, RLDataset
from hybridflow.engines.tiny import build_char_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardManager, default_compute_score


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.mark.parametrize("task", ["basic_arithmetic", "leg_counting", "chain_sum"])
def test_reasoning_gym_rows_are_scored_by_the_tasks_own_rule(task, tokenizer):
    ds = RLDataset(f"reasoning_gym:{task}?size=6&seed=3", tokenizer, max_prompt_length=4096)
    assert len(ds) == 6
    row = ds[0]
    assert row["data_source"] == f"reasoning_gym/{task}"
    assert [m["role"] for m in row["raw_prompt"]] == ["system", "user"]  # reasoning-gym's default system prompt
    assert "<answer>" in row["raw_prompt"][0]["content"]
    assert row["extra_info"]["task"] == task and row["extra_info"]["config"] == {"size": 6, "seed": 3}
    truth = row["ground_truth"]
    assert truth == row["extra_info"]["entry"]["answer"]
    score = lambda text: default_compute_score(row["data_source"], text, truth, row["extra_info"])  # noqa: E731
    assert score(f"thinking... <answer>{truth}</answer>") == 1.0
    assert score(f"<answer>{truth}1</answer>") < 1.0
    assert score(str(truth)) == 0.0  # no answer tags: nothing to score


def test_reasoning_gym_seeds_options_and_prompts(tokenizer):
    a = RLDataset("reasoning_gym:chain_sum?size=5&seed=1&system_prompt=none", tokenizer, max_prompt_length=4096)
    b = RLDataset("reasoning_gym:chain_sum?size=5&seed=1&system_prompt=none", tokenizer, max_prompt_length=4096)
    c = RLDataset("reasoning_gym:chain_sum?size=5&seed=2&system_prompt=none", tokenizer, max_prompt_length=4096)
    questions = lambda ds: [ds[i]["raw_prompt"][-1]["content"] for i in range(len(ds))]  # noqa: E731
    assert questions(a) == questions(b) != questions(c)
    assert [m["role"] for m in a[0]["raw_prompt"]] == ["user"]
    wide = RLDataset("reasoning_gym:chain_sum?size=3&seed=1&min_terms=5&max_terms=5&system_prompt=none", tokenizer,
                     max_prompt_length=4096)
    assert wide[0]["extra_info"]["config"]["min_terms"] == 5
    assert wide[0]["raw_prompt"][-1]["content"].count(" + ") + wide[0]["raw_prompt"][-1]["content"].count(" - ") == 4


@pytest.mark.parametrize(("spec", "message"), [
    ("reasoning_gym:chain_summ?size=4&seed=1", r"no task 'chain_summ'; did you mean chain_sum"),
    ("reasoning_gym:chain_sum?size=4", r"give seed \(e\.g\."),
    ("reasoning_gym:chain_sum?size=4&seed=1&bogus=3", r"refused the options .*chain_sum's options are \[.*'min_terms'"),
    ("reasoning_gym:chain_sum?size=4&seed=1&system_prompt=mine", r"system_prompt='mine'; choose none or one of"),
    ("reasoning_gym:chain_sum?size=4&seed=1&seed=2", r"'seed' is given twice"),
])
def test_reasoning_gym_bad_specs_are_named(spec, message, tokenizer):
    with pytest.raises(DataConfigError, match=message):
        RLDataset(spec, tokenizer)


def test_reasoning_gym_rows_score_in_worker_processes(tokenizer):
    """The scorer rebuilds the task in a scoring worker from what the row carries (task, config, entry)."""
    ds = RLDataset("reasoning_gym:basic_arithmetic?size=4&seed=5&system_prompt=none", tokenizer, max_prompt_length=512)
    rows = [ds[i] for i in range(4)]
    texts = [f"<answer>{r['ground_truth']}</answer>" if i % 2 == 0 else "<answer>nope</answer>" for i, r in enumerate(rows)]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    responses = torch.full((4, width), tokenizer.pad_token_id)
    mask = torch.zeros((4, width), dtype=torch.long)
    for i, e in enumerate(ids):
        responses[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    batch = DataProto.from_dict({"responses": responses, "response_mask": mask}, {
        "data_source": [r["data_source"] for r in rows], "reward_model": [r["reward_model"] for r in rows],
        "extra_info": [r["extra_info"] for r in rows],
    })
    with RewardManager(tokenizer, num_workers=1) as rm:
        result = rm(batch)
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 0.0] and result.metrics["reward/failures"] == 0


def test_hf_datasets_folder(tmp_path, tokenizer):
    import datasets  # the [data] extra, installed by the Makefile setup line
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"what is {i}+1?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"index": i}} for i in range(5)]
    folder = tmp_path / "gsm8k_hf"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    ds = RLDataset(str(folder), tokenizer, max_prompt_length=64)
    assert len(ds) == 5 and ds[2]["ground_truth"] == "3" and ds[2]["raw_prompt"][0]["content"] == "what is 2+1?"
    both = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}).save_to_disk(str(both))
    with pytest.raises(DataConfigError, match=r"is a DatasetDict with splits \['test', 'train'\]; name one split"):
        RLDataset(str(both), tokenizer)
    assert len(RLDataset(str(both / "train"), tokenizer, max_prompt_length=64)) == 5
    datasets.Dataset.from_list([{"question": "q", "answer": "a"}]).save_to_disk(str(tmp_path / "other"))
    with pytest.raises(DataConfigError, match=r"has no column\(s\) \['data_source', 'prompt'\]"):
        RLDataset(str(tmp_path / "other"), tokenizer)


def test_reasoning_gym_rows_feed_sft_with_the_gold_answer(tokenizer):
    from hybridflow.data.sft_dataset import SFTDataset

    spec = "reasoning_gym:basic_arithmetic?size=4&seed=7&system_prompt=none"
    rl = RLDataset(spec, tokenizer, max_prompt_length=512)
    sft = SFTDataset(spec, tokenizer, response_key="extra_info.response", max_length=256)
    assert len(sft) == 4
    assert rl[0]["extra_info"]["response"] == f"<answer>{rl[0]['ground_truth']}</answer>"
    assert default_compute_score(rl[0]["data_source"], rl[0]["extra_info"]["response"], rl[0]["ground_truth"],
                                 rl[0]["extra_info"]) == 1.0
