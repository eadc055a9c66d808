"""make_agent_base: demonstrations -> SFT -> a base model folder, its held-out numbers through the agent loop, and a
second stage continuing from it."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq

from hybridflow.trainer.make_agent_base import make_agent_base


def test_two_sft_stages_write_a_loadable_base_with_its_heldout_numbers(tmp_path):
    from transformers import AutoModelForCausalLM

    kwargs = {"num_train": 8, "num_val": 4, "num_sft": 40}
    first = make_agent_base("calculator", str(tmp_path / "d1"), str(tmp_path / "b1"), steps=2, batch_size=8,
                            threads=1, task_kwargs=kwargs, eval_every=1, evaluate=True)
    assert first["init"] == "random" and first["sft_steps"] == 2
    # one probe at step 1 (the last step is measured as the finished base), episodes = 4 prompts x val_kwargs.n 2
    assert [p["step"] for p in first["probes"]] == [1]
    held = first["heldout"]
    assert held["episodes"] == 8 and 0 <= held["tool_call_rate"] <= 1 and 0 <= held["accuracy"] <= 1
    second = make_agent_base("calculator", str(tmp_path / "d2"), str(tmp_path / "b2"), steps=2, batch_size=8,
                             threads=1, init=str(tmp_path / "b1"), lr=1e-3, task_kwargs=kwargs)
    assert second["init"] == str(tmp_path / "b1") and second["lr"] == 1e-3 and "heldout" not in second
    info = json.load(open(os.path.join(tmp_path, "b2", "hybridflow_base.json")))
    assert info["task"] == "calculator"
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "b2"))


def test_calculator_products_have_six_digits_and_sft_rows_are_conversations(tmp_path):
    from hybridflow.data.tasks.agent_tasks import generate_calculator_task

    files = generate_calculator_task(str(tmp_path), num_train=50, num_val=20, num_sft=200, tool_fraction=0.5)
    val = pq.read_table(files["val"]).to_pylist()
    assert all(len(r["reward_model"]["ground_truth"]) == 6 for r in val)
    sft = pq.read_table(files["sft"]).to_pylist()
    with_tool = [r["messages"] for r in sft if len(r["messages"]) == 4]
    assert 60 < len(with_tool) < 140  # about half of 200 call the tool
    for m in with_tool:
        a, b = map(int, m[0]["content"].split("*"))
        assert m[2] == {"role": "tool", "content": str(a * b)} and m[3]["content"] == f"#### {a * b}"
        assert json.loads(m[1]["content"][len("<tool_call>"):-len("</tool_call>")])["arguments"] == {
            "expression": m[0]["content"]}
