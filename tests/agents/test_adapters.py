"""Adapters against real user formats: a veRL tool config file + veRL-style tool classes, a TRL-style environment
class, and a real textarena game."""

from __future__ import annotations

import json
import re

import pytest
from agent_helpers import QWEN_STYLE_TEMPLATE, ScriptedGenerator, assistant_turns, tokenizer_with

from hybridflow.agents import AgentLoop, AgentLoopConfig, HFGenerator
from hybridflow.agents.adapters import (
    TextArenaEnvironment,
    ToolConfigError,
    load_verl_tool_config,
    trl_environment_factory,
)
from hybridflow.agents.schema import SchemaError
from hybridflow.engines.rollout.base import SamplingParams

VERL_TOOLS = '''
from uuid import uuid4


class ToolResponse:  # the shape of veRL's ToolResponse: the text is in .text
    def __init__(self, text=None):
        self.text = text


class AnswerCheckTool:
    """veRL (main) style: create(create_kwargs=...) -> (id, ToolResponse); execute -> (ToolResponse, reward, metrics)."""

    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name
        self._instances = {}
        self.log = []

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instances[instance_id] = {"ground_truth": ground_truth, "calls": 0}
        self.log.append(("create", ground_truth))
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        state = self._instances[instance_id]
        state["calls"] += 1
        answer = str(parameters.get("answer"))
        reward = 1.0 if answer == state["ground_truth"] else 0.0
        return ToolResponse(text=f"answer={answer} reward={reward}"), reward, {"calls": state["calls"]}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        self.log.append(("release", self._instances.pop(instance_id)["calls"]))


class EchoTool:
    """veRL (0.5) style: the schema comes from the class, create returns the id, execute returns text."""

    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()

    def get_openai_tool_schema(self):
        return {"type": "function", "function": {"name": "echo", "description": "Echo text.", "parameters": {
            "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

    async def create(self, instance_id=None, **kwargs):
        return instance_id or "echo-1"

    async def execute(self, instance_id, parameters, **kwargs):
        return self.config["prefix"] + parameters["text"], 0.0, {}

    async def release(self, instance_id, **kwargs):
        pass
'''

VERL_YAML = """
tools:
  - class_name: verl_style_tools.AnswerCheckTool
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: check_answer
        description: Check the final answer against the ground truth
        parameters:
          type: object
          properties:
            answer:
              type: string
              description: The model's answer
          required: ["answer"]
  - class_name: verl_style_tools.EchoTool
    config:
      type: native
      prefix: "echo: "
"""


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.fixture()
def verl_tools_dir(tmp_path, monkeypatch):
    (tmp_path / "verl_style_tools.py").write_text(VERL_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_verl_tool_config_file(tiny_lm, tiny_model_path, verl_tools_dir):
    path = verl_tools_dir / "tool_config.yaml"
    path.write_text(VERL_YAML)
    tools = load_verl_tool_config(path)
    assert [t.name for t in tools] == ["check_answer", "echo"]
    assert tools[0].parameters["properties"]["answer"]["type"] == "string"
    model, _ = tiny_lm
    tok = tokenizer_with(tiny_model_path, QWEN_STYLE_TEMPLATE)
    replies = [call("echo", text="hi"), call("check_answer", answer="42"), "done"]
    gen = ScriptedGenerator(model, tok, lambda c: replies[min(assistant_turns(c), 2)])
    loop = AgentLoop(gen, tok, AgentLoopConfig(add_tool_rewards=True), tools=tools, parser="hermes")
    rows = [{"prompt": [{"role": "user", "content": "q"}],
             "extra_info": {"tools_kwargs": {"check_answer": {"create_kwargs": {"ground_truth": gt}}}}}
            for gt in ("42", "7")]
    eps = loop.run_sync(rows)
    assert [c["output"] for c in eps[0].tool_calls] == ["echo: hi", "answer=42 reward=1.0"]
    assert [e.reward for e in eps] == [1.0, 0.0]
    assert eps[0].tool_calls[1]["metrics"] == {"calls": 1}
    assert sorted(tools[0].inner.log) == [("create", "42"), ("create", "7"), ("release", 1), ("release", 1)]
    assert '"name": "check_answer"' in tok.decode(eps[0].trajectory.prompt_ids)  # schemas reached the prompt


@pytest.mark.parametrize("text, match", [
    ("tools:\n  - class_name: verl_style_tools.Missing\n    config: {type: native}\n",
     r"tools\[0\]: module 'verl_style_tools' has no class 'Missing'"),
    ("tools:\n  - class_name: no_such_module.Tool\n    config: {type: native}\n",
     r"tools\[0\]: cannot import module 'no_such_module'"),
    ("tools:\n  - class_name: verl_style_tools.EchoTool\n    config: {type: mcp}\n", "'mcp' is not supported"),
    ("tools: []\n", "non-empty top-level 'tools:' list"),
    ("tools:\n  - class_name: verl_style_tools.EchoTool\n    tool_schema: {type: function, function: {}}\n",
     "tool_schema must be"),
])
def test_verl_tool_config_errors(verl_tools_dir, text, match):
    path = verl_tools_dir / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ToolConfigError, match=match) as info:
        load_verl_tool_config(path)
    assert str(path) in str(info.value)
    with pytest.raises(ToolConfigError, match="does not exist"):
        load_verl_tool_config(verl_tools_dir / "none.yaml")


class IncrementEnv:
    """A TRL-style environment class: public methods are tools, reset(**row), get_reward()."""

    def __init__(self):
        self.counter = 0
        self.target = None

    def reset(self, **kwargs) -> str:
        self.counter, self.target = 0, kwargs["target"]
        return f" Reach {self.target}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: how much to add
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter == self.target)


def test_trl_style_environment_class(tiny_lm, tiny_model_path):
    model, _ = tiny_lm
    tok = tokenizer_with(tiny_model_path, QWEN_STYLE_TEMPLATE)
    replies = [call("increment", step=2), call("increment", step=2), "done"]
    gen = ScriptedGenerator(model, tok, lambda c: replies[min(assistant_turns(c), 2)])
    loop = AgentLoop(gen, tok, env_factory=trl_environment_factory(IncrementEnv))
    rows = [{"prompt": [{"role": "user", "content": "Count."}], "target": t} for t in (4, 5)]
    eps = loop.run_sync(rows)
    assert [c["output"] for c in eps[0].tool_calls] == ["2", "4"]  # state is per episode
    assert [c["output"] for c in eps[1].tool_calls] == ["2", "4"]
    assert [e.reward for e in eps] == [1.0, 0.0] and eps[0].conversation[0]["content"] == "Count. Reach 4."
    assert '"name": "increment"' in tok.decode(eps[0].trajectory.prompt_ids)

    class Undocumented(IncrementEnv):
        def decrement(self, step: int) -> int:
            return step

    with pytest.raises(SchemaError, match="Undocumented: public method 'decrement' cannot become a tool"):
        trl_environment_factory(Undocumented)


def binary_search(context: str) -> str:
    lo, hi = map(int, re.search(r"between (\d+) and (\d+)", context).groups())
    guesses = [int(g) for g in re.findall(r"<\|im_start\|>assistant\n\[(\d+)\]", context)]
    hints = re.findall(r"The target number is (higher|lower)", context)
    for guess, hint in zip(guesses, hints):
        lo, hi = (guess + 1, hi) if hint == "higher" else (lo, guess - 1)
    return f"[{(lo + hi) // 2}]"


def test_textarena_game_in_process(tiny_lm):
    model, tok = tiny_lm
    gen = ScriptedGenerator(model, tok, binary_search)
    cfg = AgentLoopConfig(max_assistant_turns=10, max_response_tokens=1024, max_observation_tokens=None)
    loop = AgentLoop(gen, tok, cfg, env_factory=lambda: TextArenaEnvironment("GuessTheNumber-v0-raw"))
    eps = loop.run_sync([{"prompt": [], "seed": s} for s in range(4)])
    for ep in eps:
        assert ep.termination == "env_done" and ep.reward == 1.0, (ep.termination, ep.conversation)
        assert 1 <= ep.trajectory.num_assistant_turns <= 5  # binary search over 1..20
        assert ep.conversation[0]["content"].startswith("You are Player 0. You are playing Guess The Number.")
    assert len({tuple(e.trajectory.response_ids) for e in eps}) > 1  # the seeds chose different numbers
    # an action without [number] is an invalid move: textarena says so, then ends the game on the second one
    nonsense = AgentLoop(ScriptedGenerator(model, tok, lambda c: "no idea"), tok, cfg,
                         env_factory=lambda: TextArenaEnvironment("GuessTheNumber-v0-raw"))
    (ep,) = nonsense.run_sync([{"prompt": [], "seed": 0}])
    assert ep.termination == "env_done" and ep.reward == 0.0 and ep.trajectory.num_assistant_turns == 2
    assert "You attempted an invalid move" in ep.conversation[-2]["content"]


def test_textarena_with_sampled_generation(tiny_lm):
    """The random tiny model playing for real: episodes end by the game's rules or the loop's limits, never crash."""
    model, tok = tiny_lm
    cfg = AgentLoopConfig(max_assistant_turns=3, max_tokens_per_turn=8, max_response_tokens=600)
    loop = AgentLoop(HFGenerator(model, [tok.eos_token_id]), tok, cfg,
                     env_factory=lambda: TextArenaEnvironment("GuessTheNumber-v0-raw"))
    eps = loop.run_sync([{"prompt": [], "seed": s} for s in range(2)], SamplingParams(temperature=1.0))
    for ep in eps:
        assert ep.termination in {"env_done", "max_assistant_turns"} and ep.failure is None
        assert ep.trajectory.num_assistant_turns >= 2
