"""veRL's data.custom_cls: a user's dataset class (veRL's signature and item layout) supplies the prompts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from e2e_helpers import tiny_run_overrides

from hybridflow.data.schema import DataConfigError
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main import build_datasets, run_training

CLASS_FILE = str(Path(__file__).parent / "verl_style_dataset.py")
KEYS = [f"data.custom_cls.path={CLASS_FILE}", "data.custom_cls.name=ReversedPrompts"]


def data_overrides(files, *extra):
    return [f"data.train_files={files[0]}", f"data.val_files={files[1]}", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "data.max_prompt_length=32", *extra]


def test_the_class_items_become_the_same_prompt_rows(arithmetic_files, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    own, _ = build_datasets(load_config(data_overrides(arithmetic_files)), tok)
    custom, val = build_datasets(load_config(data_overrides(arithmetic_files, *KEYS, "data.return_raw_chat=true")), tok)
    mine, theirs = own.dataset, custom.dataset
    assert type(theirs).__name__ == "CustomClassDataset" and len(theirs) == len(mine) > 0
    for i in (0, 1, len(mine) - 1):  # the class reverses the rows: padding dropped, same tokens and fields
        a, b = mine[i], theirs[len(mine) - 1 - i]
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert (a["data_source"], a["ground_truth"], a["raw_prompt"]) == (b["data_source"], b["ground_truth"],
                                                                          b["raw_prompt"])
    assert len(val.dataset) == len(build_datasets(load_config(data_overrides(arithmetic_files)), tok)[1].dataset)
    batch = next(custom.iter_batches())
    assert batch.batch["input_ids"].shape[0] == 4 and "raw_prompt" in batch.non_tensor_batch


def test_a_run_trains_on_the_class_prompts(arithmetic_files, tiny_model_path, tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local",
                                         "trainer.total_training_steps=1", *KEYS))
    assert run_training(cfg, progress=False).global_step == 1
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert rows[-1]["data/train_rows"] == 128


def test_bad_classes_and_keys_are_named(arithmetic_files, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    with pytest.raises(DataConfigError, match=r"custom_cls.name='NotADataset' .* must be a class inheriting from "
                                              r"torch.utils.data.Dataset"):
        build_datasets(load_config(data_overrides(arithmetic_files, KEYS[0], "data.custom_cls.name=NotADataset")), tok)
    with pytest.raises(DataConfigError, match=r"custom_cls.name='Missing': .* defines no such name"):
        build_datasets(load_config(data_overrides(arithmetic_files, KEYS[0], "data.custom_cls.name=Missing")), tok)
    with pytest.raises(ConfigError, match=r"custom_cls.path=.* needs data.custom_cls.name"):
        load_config([KEYS[0]])
    with pytest.raises(ConfigError, match=r"custom_cls.path='nope.py' is not a file"):
        load_config(["data.custom_cls.path=nope.py", "data.custom_cls.name=X"])
