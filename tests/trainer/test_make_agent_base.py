"""make_agent_base: demonstrations -> SFT -> a base model folder, and a second stage continuing from it."""

from __future__ import annotations

import json
import os

from hybridflow.trainer.make_agent_base import make_agent_base


def test_two_sft_stages_write_a_loadable_base(tmp_path):
    from transformers import AutoModelForCausalLM

    kwargs = {"num_train": 8, "num_val": 4, "num_sft": 40}
    first = make_agent_base("calculator", str(tmp_path / "d1"), str(tmp_path / "b1"), steps=2, batch_size=8,
                            threads=1, task_kwargs={**kwargs, "answer_repeats": 1})
    assert first["init"] == "random" and first["sft_steps"] == 2
    second = make_agent_base("calculator", str(tmp_path / "d2"), str(tmp_path / "b2"), steps=2, batch_size=8,
                             threads=1, init=str(tmp_path / "b1"), lr=1e-3, task_kwargs=kwargs)
    assert second["init"] == str(tmp_path / "b1") and second["lr"] == 1e-3
    info = json.load(open(os.path.join(tmp_path, "b2", "hybridflow_base.json")))
    assert info["task"] == "calculator"
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "b2"))
