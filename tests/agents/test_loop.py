"""The agent loop over a real tiny model: tool episodes, limits, and every bad input ending as a counted error."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import pytest
from agent_helpers import QWEN_STYLE_TEMPLATE, ScriptedGenerator, assistant_turns, tokenizer_with

from hybridflow.agents import AgentFailureError, AgentLoop, AgentLoopConfig, Generation, Tool, ToolResult
from hybridflow.agents.collate import collate_episodes
from hybridflow.agents.loop import UNPARSED_CALL_NAME
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.workers.agent_rollout import agent_batch_metrics

# What a "hung" tool or environment waits on in its thread: far longer than its timeout unless a test lets it go, so
# a timeout that fails to cut it shows up as a slow episode (the bounds leave room for a loaded machine), and no
# sleeping thread outlives the test.
HUNG_S = 30
_LET_GO = threading.Event()


@pytest.fixture
def let_hung_threads_go():
    _LET_GO.clear()
    yield
    _LET_GO.set()


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def first_user(context: str) -> str:
    return context.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


def tool_responses(context: str) -> list[str]:
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.DOTALL)


def scripted(task_scripts: dict):
    """Script keyed by the row's user message: a list of replies (str or callable(context) -> str) per turn."""
    def script(context: str) -> str:
        replies = task_scripts[first_user(context)]
        reply = replies[min(assistant_turns(context), len(replies) - 1)]
        return reply(context) if callable(reply) else reply
    return script


def row(task: str, **extra) -> dict:
    return {"prompt": [{"role": "user", "content": task}], **extra}


@pytest.fixture()
def qwen_tok(tiny_model_path):
    return tokenizer_with(tiny_model_path, QWEN_STYLE_TEMPLATE)


def test_tool_episode_tokens_masks_records_and_score(tiny_lm, qwen_tok):
    model, _ = tiny_lm
    seen = {}

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        seen.update(extra_info)
        return float(solution_str.strip().endswith(str(ground_truth)))

    gen = ScriptedGenerator(model, qwen_tok, scripted({
        "123*45?": [call("multiply", a=123, b=45), lambda c: f"It is {tool_responses(c)[-1]}"]}))
    loop = AgentLoop(gen, qwen_tok, AgentLoopConfig(), tools=[multiply], compute_score=compute_score)
    (ep,) = loop.run_sync([row("123*45?", data_source="calc", reward_model={"ground_truth": 5535},
                               extra_info={"index": 7})])
    assert ep.termination == "stop" and ep.reward == 1.0 and ep.num_turns == 3
    traj = ep.trajectory
    obs = traj.turns[1]
    assert obs.kind == "observation" and obs.role == "tool"
    assert qwen_tok.decode(traj.response_ids[obs.start:obs.end]) == (
        "\n<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert traj.response_mask == [1] * obs.start + [0] * (obs.end - obs.start) + [1] * (len(traj.response_ids) - obs.end)
    assert all(lp == 0.0 for lp in traj.log_probs[obs.start:obs.end])
    assert all(lp < 0.0 for lp in traj.log_probs[:obs.start])
    assert [(c["name"], c["arguments"], c["error"], c["output"]) for c in ep.tool_calls] == [
        ("multiply", {"a": 123, "b": 45}, None, "5535")]
    assert seen["index"] == 7 and seen["num_turns"] == 3 and seen["tool_calls"][0]["output"] == "5535"
    assert [m["role"] for m in seen["turns"]] == ["user", "assistant", "tool", "assistant"]
    with pytest.raises(RuntimeError, match=r"compute_score raised on row 0 \(data_source 'calc'\): KeyError"):
        AgentLoop(gen, qwen_tok, tools=[multiply], compute_score=lambda **kw: {}["x"]).run_sync(
            [row("123*45?", data_source="calc")])
    m = ep.metrics()
    assert m["tool_calls"] == 1 and m["assistant_turns"] == 2 and 0 < m["observation_token_share"] < 1


def test_a_single_turn_agent_row_is_one_generation_without_tools_or_environment(tiny_lm, qwen_tok):
    """veRL's per-row agent_name: single_turn_agent rows are plain generations in a batch of tool episodes."""
    model, _ = tiny_lm
    contexts = []

    def reply(context: str) -> str:
        contexts.append(context)
        return call("multiply", a=2, b=3) if assistant_turns(context) == 0 else "6"

    made = []

    class Env:  # no reset or step: only its construction is seen
        def __init__(self):
            made.append(self)

    gen = ScriptedGenerator(model, qwen_tok, reply)
    loop = AgentLoop(gen, qwen_tok, AgentLoopConfig(), tools=[multiply], env_factory=Env)
    tool_ep, single, default = loop.run_sync([row("2*3?", agent_name="tool_agent"),
                                              row("2*3?", agent_name="single_turn_agent"), row("2*3?")])
    assert tool_ep.num_turns == 3 and [c["name"] for c in tool_ep.tool_calls] == ["multiply"]
    assert default.num_turns == 3  # no agent_name: the loop's episode
    assert single.num_turns == 1 and single.tool_calls == [] and single.termination == "stop"
    assert single.conversation[-1]["content"] == call("multiply", a=2, b=3)  # its text is the answer, not run
    assert len(made) == 2  # no environment for the single-turn row
    without_tools = qwen_tok.decode(qwen_tok.apply_chat_template([{"role": "user", "content": "2*3?"}],
                                                                 add_generation_prompt=True, tokenize=True))
    assert sum(c == without_tools for c in contexts) == 1 and sum('"multiply"' in c for c in contexts) >= 2


def test_model_mistakes_become_error_observations(tiny_lm, qwen_tok):
    model, _ = tiny_lm
    gen = ScriptedGenerator(model, qwen_tok, scripted({
        "json": ['<tool_call>{"name": "multiply", "arguments": {"a": 1,</tool_call>', "done"],
        "unknown": [call("divide", a=1, b=2), "done"],
        "types": [call("multiply", a="12", b=3), "done"],
        "missing": [call("multiply", a=2), "done"],
        "unterminated": ['<tool_call>{"name": "multiply"', "done"],
    }))
    loop = AgentLoop(gen, qwen_tok, AgentLoopConfig(), tools=[multiply])
    eps = loop.run_sync([row("json"), row("unknown"), row("types"), row("missing"), row("unterminated")])
    kinds = [dict(e.tool_errors) for e in eps]
    assert kinds == [{"malformed_json": 1}, {"unknown_tool": 1}, {"bad_arguments": 1}, {"bad_arguments": 1},
                     {"unterminated": 1}]
    # a call whose name could not be read is counted under a name no tool can have, never under None
    assert [e.tool_calls[0]["name"] for e in eps] == [
        UNPARSED_CALL_NAME, "divide", "multiply", "multiply", UNPARSED_CALL_NAME]
    by_name = {k: v for k, v in agent_batch_metrics(collate_episodes(eps, pad_token_id=0)).items()
               if k.startswith("agent/tool_calls_by_name/")}
    assert by_name == {"agent/tool_calls_by_name/<unparsed>": 2.0, "agent/tool_calls_by_name/divide": 1.0,
                       "agent/tool_calls_by_name/multiply": 2.0}
    outputs = [e.tool_calls[0]["output"] for e in eps]
    assert outputs[0].startswith("Error: could not read the tool call: invalid JSON")
    assert outputs[1] == "Error: unknown tool 'divide'; available tools: ['multiply']."
    assert "argument 'a' must be integer, got str" in outputs[2]
    assert "missing required argument(s) ['b']" in outputs[3]
    for e in eps:  # the model was told, and answered
        assert e.termination == "stop" and e.failure is None and e.trajectory.num_assistant_turns == 2
        assert e.tool_calls[0]["output"] in gen.tokenizer.decode(e.trajectory.response_ids)


class Flaky(Tool):
    """Stateful tool: counts create/release per episode; misbehaves on request."""

    def __init__(self):
        super().__init__("flaky", "Does what it is told.", {
            "type": "object", "properties": {"mode": {"type": "string"}}, "required": ["mode"]})
        self.created, self.released = 0, []

    def create(self, **kwargs):
        self.created += 1
        return {"calls": 0, **kwargs}

    def execute(self, state, arguments):
        state["calls"] += 1
        mode = arguments["mode"]
        if mode == "raise":
            raise ValueError("boom")
        if mode == "hang":
            _LET_GO.wait(HUNG_S)  # a sync tool stuck in a thread
        if mode == "huge":
            return "7" * 3_000_000
        return ToolResult(f"ok {state['calls']} {state.get('tag')}", reward=0.5, metrics={"m": 1.0})

    def release(self, state):
        self.released.append(state["calls"])


class AsyncHang(Tool):
    def __init__(self):
        super().__init__("slow", "Never answers.", {"type": "object", "properties": {}})

    async def execute(self, state, arguments):
        await asyncio.sleep(30)


def test_tool_failures_cost_their_episode_not_the_batch(tiny_lm, qwen_tok, let_hung_threads_go):
    model, _ = tiny_lm
    flaky = Flaky()
    gen = ScriptedGenerator(model, qwen_tok, scripted({
        "raise": [call("flaky", mode="raise"), "done"],
        "hang": [call("flaky", mode="hang"), "done"],
        "ahang": [call("slow"), "done"],
        "huge": [call("flaky", mode="huge"), "done"],
        "ok": [call("flaky", mode="ok"), call("flaky", mode="ok"), "done"],
    }))
    cfg = AgentLoopConfig(tool_timeout_s=0.3, max_observation_tokens=48, add_tool_rewards=True,
                          max_failure_fraction=1.0)
    loop = AgentLoop(gen, qwen_tok, cfg, tools=[flaky, AsyncHang()])
    start = time.monotonic()
    rows = [row("raise"), row("hang"), row("ahang"), row("huge"),
            row("ok", tools_kwargs={"flaky": {"create_kwargs": {"tag": "T"}}})]
    eps = loop.run_sync(rows)
    # Neither hung tool was waited out (HUNG_S in a thread, 30 s awaited): each was abandoned at its 0.3 s timeout. The
    # bound leaves room for a loaded machine (the suite runs two test processes on two cores).
    assert time.monotonic() - start < HUNG_S - 2
    by = {r["prompt"][0]["content"]: e for r, e in zip(rows, eps)}
    assert dict(by["raise"].tool_errors) == {"raised": 1}
    assert by["raise"].tool_calls[0]["output"] == "Error: tool 'flaky' failed: ValueError: boom"
    assert by["raise"].failure == "tool 'flaky': raised: ValueError: boom"
    assert dict(by["hang"].tool_errors) == {"timeout": 1} and dict(by["ahang"].tool_errors) == {"timeout": 1}
    assert "timed out after 0.3 s" in by["ahang"].tool_calls[0]["output"]
    huge = by["huge"].tool_calls[0]
    assert huge["error"] is None and huge["truncated"] and huge["output"] == "7" * 48 + "...(truncated)"
    assert by["huge"].observations_truncated == 1 and by["huge"].failure is None
    ok = by["ok"]
    assert [c["output"] for c in ok.tool_calls] == ["ok 1 T", "ok 2 T"] and ok.reward == 1.0
    assert ok.tool_calls[0]["metrics"] == {"m": 1.0}
    assert all(e.termination == "stop" for e in eps)
    # one create per episode that called the tool, one release each, with that episode's state
    assert flaky.created == 4 and sorted(flaky.released) == [1, 1, 1, 2]


class ModelFree:
    """A Generator without a model (so that the event loop is never busy for long): `script(context) -> reply`,
    its tokens + eos, log-probs 0."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script

    async def generate(self, prompt_token_ids, max_new_tokens, sampling):
        reply = self.script(self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False))
        ids = [*self.tokenizer(reply, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
        ids = ids[:max_new_tokens]
        return Generation(ids, [0.0] * len(ids), "stop" if ids[-1] == self.tokenizer.eos_token_id else "length")


def test_hung_sync_tools_cost_threads_not_the_healthy_calls(qwen_tok, let_hung_threads_go):
    """Half the calls hang far past their timeout, twice as many as there are tool threads: every healthy call still
    succeeds (waiting for a free thread is not part of a call's timeout, and a timed-out call frees its slot), the
    batch ends in about two timeouts, not when the hung threads return, and a function tool, which has nothing to
    create or release, is never queued for either."""
    def work(n: int) -> str:
        """Do some work.

        Args:
            n: the work's number
        """
        if n % 2:
            _LET_GO.wait(HUNG_S)
        return f"did {n}"

    gen = ModelFree(qwen_tok, lambda c: call("work", n=int(first_user(c))) if assistant_turns(c) == 0 else "done")
    cfg = AgentLoopConfig(tool_timeout_s=0.5, tool_threads=4, max_failure_fraction=1.0)
    rows = [row(str(i)) for i in range(16)]
    start = time.monotonic()
    eps = AgentLoop(gen, qwen_tok, cfg, tools=[work]).run_sync(rows)
    assert time.monotonic() - start < HUNG_S - 2  # the 8 hung calls were abandoned at their timeouts
    healthy, hung = eps[0::2], eps[1::2]
    assert [e.tool_calls[0]["output"] for e in healthy] == [f"did {i}" for i in range(0, 16, 2)]
    assert all(e.failure is None and e.termination == "stop" and not e.tool_errors for e in healthy)
    assert all(dict(e.tool_errors) == {"timeout": 1} and e.termination == "stop" for e in hung)
    assert all(e.failure == "tool 'work': timeout: no answer within tool_timeout_s=0.5" for e in hung)


def test_error_observations_are_cut_like_tool_results(tiny_lm, qwen_tok):
    """A long error (a raised exception's message) is cut to max_observation_tokens on the configured side, so it
    fits what is left of the response budget and the model sees it; uncut, it would not fit and would be dropped."""
    model, _ = tiny_lm

    def evaluate(expression: str) -> str:
        """Evaluate an expression.

        Args:
            expression: what to evaluate
        """
        raise ValueError(f"cannot parse {expression!r}: " + "unexpected token; " * 40)

    gen = ScriptedGenerator(model, qwen_tok, scripted({"1+": [call("evaluate", expression="1+"), "sorry"]}))

    def run(**cfg):
        cfg = AgentLoopConfig(max_response_tokens=200, max_failure_fraction=1.0, **cfg)
        loop = AgentLoop(gen, qwen_tok, cfg, tools=[evaluate])
        return loop.run_sync([row("1+")])[0]

    ep = run(max_observation_tokens=24, observation_truncate_side="left")
    record = ep.tool_calls[0]
    assert record["error"] == "raised" and record["truncated"] and ep.observations_truncated == 1
    kept = record["output"].removesuffix("...(truncated)")
    assert kept.startswith("Error: tool 'evaluate' f")
    assert len(qwen_tok(kept, add_special_tokens=False)["input_ids"]) == 24
    assert record["detail"].startswith("ValueError: cannot parse '1+': unexpected token;")  # the whole story kept
    assert ep.termination == "stop" and ep.conversation[-1] == {"role": "assistant", "content": "sorry"}
    assert record["output"] in qwen_tok.decode(ep.trajectory.response_ids)  # the model saw it
    right = run(max_observation_tokens=24, observation_truncate_side="right").tool_calls[0]["output"]
    assert right.startswith("...(truncated)") and "Error" not in right and "unexpected token; " in right
    assert run(max_observation_tokens=None).termination == "response_budget"  # what happened before: dropped
    # uncut by tokens, an exception's text is still kept short (the whole of it stays in the record's detail)
    big = AgentLoop(gen, qwen_tok, AgentLoopConfig(max_observation_tokens=None, max_failure_fraction=1.0),
                    tools=[evaluate])
    assert len(big.run_sync([row("1+")])[0].tool_calls[0]["output"]) < 300


def test_failure_fraction_stops_naming_the_tool_and_first_sample(tiny_lm, qwen_tok):
    model, _ = tiny_lm
    gen = ScriptedGenerator(model, qwen_tok, scripted({
        "raise": [call("flaky", mode="raise"), "done"], "ok": [call("flaky", mode="ok"), "done"]}))
    loop = AgentLoop(gen, qwen_tok, AgentLoopConfig(max_failure_fraction=0.5), tools=[Flaky()])
    with pytest.raises(AgentFailureError, match=r"2 of 3 episodes.*first failing sample: row 1: tool 'flaky': "
                                                r"raised: ValueError: boom"):
        loop.run_sync([row("ok"), row("raise"), row("raise")])
    assert len(loop.run_sync([row("ok"), row("raise")])) == 2  # 50% is tolerated


class GuessEnv:
    def __init__(self, fail_in=None, bad_return=False):
        self.fail_in, self.bad_return, self.steps = fail_in, bad_return, 0

    def reset(self, **row):
        if self.fail_in == "reset":
            raise RuntimeError("no game today")
        if self.fail_in == "reset_hang":
            _LET_GO.wait(HUNG_S)
        return f" Guess {row['extra_info']['secret'] % 3}."

    def step(self, action):
        self.steps += 1
        if self.fail_in == "step":
            raise KeyError("lost state")
        if self.fail_in == "step_hang":
            _LET_GO.wait(HUNG_S)
        if self.bad_return:
            return "only text"
        return ("right" if "[2]" in action else "wrong"), 0.25, "[2]" in action, {}

    def get_reward(self):
        if self.fail_in == "reward":
            raise ZeroDivisionError("no reward")
        return 1.0


def test_environment_failures_end_the_episode_with_the_failure_reward(tiny_lm, let_hung_threads_go):
    model, tok = tiny_lm
    gen = ScriptedGenerator(model, tok, lambda c: ["[1]", "[2]"][min(assistant_turns(c), 1)])
    cfg = AgentLoopConfig(failure_reward=-1.0, max_failure_fraction=1.0, env_timeout_s=0.2)
    rows = [row("go", extra_info={"secret": 5})]
    seen = {}

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        seen.update(extra_info)
        return 0.0

    ok = AgentLoop(gen, tok, cfg, env_factory=GuessEnv, compute_score=compute_score).run_sync(rows)[0]
    assert ok.termination == "env_done" and ok.env_rewards == [0.25, 0.25] and ok.reward == 1.5
    # the scorer sees the step rewards, and the environment's total under the key the training path uses
    assert seen["env_rewards"] == [0.25, 0.25] and seen["env_reward"] == 1.5
    assert ok.conversation[0]["content"] == "go Guess 2."  # reset's text joins the last user message
    results = {}
    cases = {"reset": lambda: GuessEnv("reset"), "step": lambda: GuessEnv("step"),
             "bad": lambda: GuessEnv(bad_return=True), "ctor": lambda: 1 / 0, "reward": lambda: GuessEnv("reward"),
             "reset_hang": lambda: GuessEnv("reset_hang"), "step_hang": lambda: GuessEnv("step_hang")}
    for name, factory in cases.items():
        (ep,) = AgentLoop(gen, tok, cfg, env_factory=factory).run_sync(rows)
        results[name] = ep
        assert ep.termination == "env_error" and ep.reward == -1.0
    assert dict(results["reset"].env_errors) == {"reset_raised": 1}
    assert results["reset"].trajectory.response_ids == []  # nothing was generated
    assert results["reset"].failure == "environment GuessEnv: reset_raised: RuntimeError: no game today"
    assert dict(results["step"].env_errors) == {"step_raised": 1}
    assert dict(results["bad"].env_errors) == {"bad_step_return": 1}
    assert "must return (observation, reward | None, done, info)" in results["bad"].failure
    assert dict(results["ctor"].env_errors) == {"construct_raised": 1}
    assert dict(results["reward"].env_errors) == {"reward_raised": 1}
    assert dict(results["reset_hang"].env_errors) == {"reset_timeout": 1}
    assert dict(results["step_hang"].env_errors) == {"step_timeout": 1}
    assert results["step_hang"].env_time_s < HUNG_S / 2  # abandoned at its 0.2 s timeout, not waited out
    closed = []

    class Closing(GuessEnv):

        def close(self):
            closed.append(self.fail_in)

    for fail_in in ("reset", "step", None):
        AgentLoop(gen, tok, cfg, env_factory=lambda f=fail_in: Closing(f)).run_sync(rows)
    assert closed == ["reset", "step", None]  # closed however the episode ended
    with pytest.raises(AgentFailureError, match="environment GuessEnv: step_raised"):
        AgentLoop(gen, tok, AgentLoopConfig(max_failure_fraction=0.0),
                  env_factory=lambda: GuessEnv("step")).run_sync(rows)


def test_limits(tiny_lm, qwen_tok):
    model, _ = tiny_lm
    always = ScriptedGenerator(model, qwen_tok, lambda c: call("multiply", a=2, b=3))
    rows = [row("x")]

    def run(**cfg):
        return AgentLoop(always, qwen_tok, AgentLoopConfig(**cfg), tools=[multiply]).run_sync(rows)[0]

    ep = run(max_assistant_turns=3, max_tool_calls=None)
    assert ep.termination == "max_assistant_turns" and ep.trajectory.num_assistant_turns == 3
    # the last allowed turn's call is not run: no turn would read its result, and the episode ends on the model's turn
    assert len(ep.tool_calls) == 2 and ep.trajectory.turns[-1].kind == "assistant"
    ep = run(max_tool_calls=2, max_assistant_turns=None)
    assert ep.termination == "max_tool_calls" and len(ep.tool_calls) == 2
    ep = run(max_user_turns=1, max_tool_calls=None)
    assert ep.termination == "max_user_turns" and sum(t.kind == "observation" for t in ep.trajectory.turns) == 1
    ep = run(max_response_tokens=200, max_tool_calls=None, max_assistant_turns=None)
    assert ep.termination == "response_budget" and len(ep.trajectory.response_ids) <= 200
    assert ep.trajectory.turns[-1].kind == "assistant"  # an episode ends on the model's turn
    ep = run(max_tokens_per_turn=10, max_assistant_turns=1)
    assert ep.trajectory.turns[0].finish_reason == "length" and len(ep.trajectory.response_ids) == 10
    two = ScriptedGenerator(model, qwen_tok, scripted({"x": [call("multiply", a=1, b=1) * 3, "done"]}))
    cfg = AgentLoopConfig(max_parallel_calls=2, max_tokens_per_turn=256)
    ep = AgentLoop(two, qwen_tok, cfg, tools=[multiply]).run_sync(rows)[0]
    assert [c["error"] for c in ep.tool_calls] == [None, None, "call_limit"]
    with pytest.raises(ValueError, match="max_tokens_per_turn must be >= 1"):
        AgentLoopConfig(max_tokens_per_turn=0).validate()
    # max_user_turns=0: the model answers once; its tool call ends the episode unrun
    ep = run(max_user_turns=0)
    assert ep.termination == "max_user_turns" and ep.num_turns == 1 and ep.tool_calls == []
    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        AgentLoop(always, qwen_tok, tools=[multiply, multiply])
    with pytest.raises(ValueError, match="row 0: 'raw_prompt' / 'prompt' must be a list of chat messages"):
        AgentLoop(always, qwen_tok, tools=[multiply]).run_sync([{"prompt": "hi"}])


def test_limits_that_would_leave_nothing_to_train_on_are_refused(tiny_lm):
    """max_assistant_turns=0 made every episode empty and training ran on nothing; 0 for a limit that cannot be 0 is
    refused, naming the key (veRL reads 0 as no limit: None is that here). max_user_turns=0 is meaningful."""
    for key in ("max_assistant_turns", "max_tool_calls", "max_observation_tokens"):
        with pytest.raises(ValueError, match=f"{key} must be >= 1, or None for no limit"):
            AgentLoopConfig(**{key: 0}).validate()
        AgentLoopConfig(**{key: None}).validate()
    with pytest.raises(ValueError, match="max_assistant_turns must be >= 1"):
        AgentLoop(None, None, AgentLoopConfig(max_assistant_turns=-1))
    with pytest.raises(ValueError, match=r"max_user_turns must be >= 0 \(0: the model answers once\)"):
        AgentLoopConfig(max_user_turns=-1).validate()
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.multi_turn: agent loop: max_assistant_turns "
                                          r"must be >= 1, or None for no limit \(veRL reads 0 as no limit\), got 0"):
        load_config(["data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
                     "actor_rollout_ref.rollout.multi_turn.environment=guess_number",
                     "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0"])
    # max_user_turns=0 with an environment: one answer, stepped (so scored), no observation appended
    model, tok = tiny_lm
    gen = ScriptedGenerator(model, tok, lambda c: "[1]")
    (ep,) = AgentLoop(gen, tok, AgentLoopConfig(max_user_turns=0), env_factory=GuessEnv).run_sync(
        [row("go", extra_info={"secret": 5})])
    assert ep.termination == "max_user_turns" and ep.num_turns == 1 and ep.env_rewards == [0.25]
    assert ep.reward == 1.25  # the step's reward + get_reward()
    # the same for the last turn max_assistant_turns allows: stepped and scored, no observation after it
    (ep,) = AgentLoop(gen, tok, AgentLoopConfig(max_assistant_turns=2), env_factory=GuessEnv).run_sync(
        [row("go", extra_info={"secret": 5})])
    assert ep.termination == "max_assistant_turns" and ep.env_rewards == [0.25, 0.25]
    assert ep.trajectory.turns[-1].kind == "assistant" and ep.num_turns == 3


def test_tool_calls_of_many_episodes_overlap(tiny_lm, qwen_tok):
    model, _ = tiny_lm

    async def wait(seconds: float) -> str:
        """Wait a while.

        Args:
            seconds: how long
        """
        await asyncio.sleep(seconds)
        return "waited"

    gen = ScriptedGenerator(model, qwen_tok, scripted({"w": [call("wait", seconds=0.4), "done"]}))
    start = time.monotonic()
    eps = AgentLoop(gen, qwen_tok, tools=[wait]).run_sync([row("w")] * 6)
    assert time.monotonic() - start < 6 * 0.4 * 0.6
    assert all(e.tool_calls[0]["output"] == "waited" for e in eps)
    start = time.monotonic()
    AgentLoop(gen, qwen_tok, AgentLoopConfig(max_concurrent_episodes=1), tools=[wait]).run_sync([row("w")] * 3)
    assert time.monotonic() - start >= 3 * 0.4  # one episode at a time


def test_a_generator_error_stops_the_batch_without_orphans(tiny_lm, qwen_tok):
    model, _ = tiny_lm

    async def nap(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        await asyncio.sleep(seconds)
        return "rested"

    inner = ScriptedGenerator(model, qwen_tok, scripted({"nap": [call("nap", seconds=30), "done"], "bad": ["x"]}))

    class Broken:
        async def generate(self, prompt_token_ids, max_new_tokens, sampling):
            if "bad" in qwen_tok.decode(prompt_token_ids):
                await asyncio.sleep(0.1)
                raise RuntimeError("engine crashed")
            return await inner.generate(prompt_token_ids, max_new_tokens, sampling)

    loop = AgentLoop(Broken(), qwen_tok, AgentLoopConfig(tool_timeout_s=60), tools=[nap])

    async def main():
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="engine crashed"):
            await loop.run([row("nap"), row("bad")])
        assert time.monotonic() - start < 5
        assert asyncio.all_tasks() == {asyncio.current_task()}  # the napping episode was cancelled, not orphaned

    asyncio.run(main())


def test_release_and_close_failures_are_counted(tiny_lm, qwen_tok):
    model, _ = tiny_lm

    class BadRelease(Flaky):
        def release(self, state):
            raise OSError("disk gone")

    class BadClose(GuessEnv):
        def close(self):
            raise OSError("socket gone")

    gen = ScriptedGenerator(model, qwen_tok, scripted({"ok Guess 1.": [call("flaky", mode="ok"), "[2]"]}))
    loop = AgentLoop(gen, qwen_tok, tools=[BadRelease()], env_factory=BadClose)
    (ep,) = loop.run_sync([row("ok", extra_info={"secret": 1})])
    assert ep.termination == "env_done" and ep.failure is None and ep.reward == 1.25
    assert dict(ep.tool_errors) == {"release_raised": 1} and dict(ep.env_errors) == {"close_raised": 1}
