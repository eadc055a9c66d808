"""The agent loop: many episodes at once on asyncio, each generate -> act -> observe -> generate until it ends.

Per episode (one row):
  1. an environment from ``env_factory`` (if any) is reset with the row; its first observation joins the prompt;
  2. the prompt is rendered once (trajectory.py); then, until a limit or the end:
     generate a turn from exactly the trajectory's tokens; parse its tool calls; if there are calls, run them
     (concurrently, each under ``tool_timeout_s`` of its own run time) and append their results as a ``tool`` delta
     (an error observation, like a result, cut to ``max_observation_tokens``); else, if the
     environment has ``step``, step it with the turn's text and append its observation as a ``user`` delta; else the
     episode is over (the model answered);
  3. rewards: the environment's (per-step rewards + ``get_reward()``) and the user's
     ``compute_score(data_source, solution_str, ground_truth, extra_info)`` (extra_info carries the turns, the tool
     calls and the termination reason) are added, and the tools' per-call rewards if ``add_tool_rewards``; an
     environment failure replaces them with ``failure_reward``.

A row whose ``agent_name`` (veRL's per-row column) is ``single_turn_agent`` is one generation from its prompt, with
no tools in the prompt and no environment, as veRL's single-turn agent loop; other rows are episodes as above.

Failures never escape an episode: a tool that raises, hangs or returns too much, an environment that raises in
reset / step / get_reward, a malformed call, an unknown tool, wrong argument types all become an error observation
or the end of the episode, counted by kind in the episode's metrics. Only when more than ``max_failure_fraction`` of
a batch's episodes hit a tool or environment failure does ``run`` raise ``AgentFailureError``, naming the culprit and
the first failing sample. A generator error is not an episode's fault and propagates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.environment import read_step
from hybridflow.agents.generator import Generator
from hybridflow.agents.parsers import ParsedResponse, ToolCall, ToolCallParser, get_parser
from hybridflow.agents.schema import check_arguments
from hybridflow.agents.tools import Tool, ToolThreads, as_tool, call_maybe_async, has_own, to_tool_result
from hybridflow.agents.trajectory import TRUNCATE_SIDES, ChatRenderer, Trajectory, truncate_text
from hybridflow.engines.rollout.base import SamplingParams

__all__ = ["SINGLE_TURN_AGENT", "AgentFailureError", "AgentLoop", "AgentLoopConfig", "Episode", "summarize_episodes"]

SINGLE_TURN_AGENT = "single_turn_agent"  # a row's agent_name for one generation without tools or environment

# Tool-call outcomes that are the tool's or environment's fault (they count towards max_failure_fraction);
# the others are the model's mistakes, answered with an error observation so that it can learn from them.
FAILURE_KINDS = frozenset({"raised", "timeout", "create_raised"})

# The name recorded for a call whose name could not be read (malformed JSON, no "name", an unterminated call), so
# that per-name counts (agent/tool_calls_by_name/...) have a key that no tool can have (function names are
# [A-Za-z0-9_-]); what went wrong is counted by kind in tool_errors.
UNPARSED_CALL_NAME = "<unparsed>"
ERROR_TEXT_CHARS = 200  # of an exception's message in an error observation (then cut to max_observation_tokens)


class AgentFailureError(RuntimeError):
    """Too many episodes of a batch failed in their tools or environments."""


@dataclass
class AgentLoopConfig:
    """Limits of one episode (None: no limit) and of the batch. Token counts are tokens of the response part."""

    max_assistant_turns: int | None = 8  # >= 1 (veRL reads 0 as no limit: here that is None)
    # observations appended (tool results or environment messages); 0: the model answers once - a turn's tool calls
    # end the episode unrun, an environment is still stepped on the answer (to score it) but nothing is appended
    max_user_turns: int | None = None
    max_tool_calls: int | None = 16  # per episode, >= 1; a turn asking for more gets error observations for the rest
    max_parallel_calls: int = 4  # per turn; calls beyond it are answered with an error
    max_response_tokens: int = 512  # generated + observation tokens of the whole episode
    max_tokens_per_turn: int = 128
    max_observation_tokens: int | None = 256  # per tool result / error / environment message, before the template
    observation_truncate_side: str = "left"  # what a cut observation keeps: left (its start) | middle | right
    tool_timeout_s: float | None = 10.0
    env_timeout_s: float | None = 30.0
    max_failure_fraction: float = 0.5  # > this fraction of episodes with a tool/env failure stops the batch
    failure_reward: float = 0.0  # the reward of an episode whose environment failed
    add_tool_rewards: bool = False  # add the tools' per-call rewards to the episode reward (veRL ignores them)
    max_concurrent_episodes: int | None = None
    # sync tool / environment calls running at once, each in its own thread; a call past its timeout frees its slot
    # (its thread runs on, abandoned), so a hung tool never starves the others
    tool_threads: int = 16
    seed: int = 0  # seeds the loop's draw of a base seed per run() when sampling.seed is None

    def validate(self) -> None:
        if self.max_assistant_turns is not None and self.max_assistant_turns < 1:
            # 0 would make every episode empty (no turn generated) and train on nothing, silently
            raise ValueError(f"agent loop: max_assistant_turns must be >= 1, or None for no limit (veRL reads 0 as "
                             f"no limit), got {self.max_assistant_turns}")
        if self.max_user_turns is not None and self.max_user_turns < 0:
            raise ValueError(f"agent loop: max_user_turns must be >= 0 (0: the model answers once) or None for no "
                             f"limit, got {self.max_user_turns}")
        for name, why in (("max_tool_calls", "0 would end every episode at its first call without running it; to "
                                            "run without tools, configure none"),
                          ("max_observation_tokens", "0 would cut every tool result to nothing")):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"agent loop: {name} must be >= 1, or None for no limit ({why}), got {value}")
        for name in ("max_parallel_calls", "max_response_tokens", "max_tokens_per_turn", "tool_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"agent loop: {name} must be >= 1, got {getattr(self, name)}")
        if self.observation_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"agent loop: observation_truncate_side must be one of {TRUNCATE_SIDES}, got "
                             f"{self.observation_truncate_side!r}")
        if not 0.0 <= self.max_failure_fraction <= 1.0:
            raise ValueError(f"agent loop: max_failure_fraction must be in [0, 1], got {self.max_failure_fraction}")
        for name in ("tool_timeout_s", "env_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"agent loop: {name} must be > 0 seconds or None, got {value}")


@dataclass
class Episode:
    """One finished episode: its tokens, how it ended, its reward and what happened on the way."""

    index: int
    trajectory: Trajectory
    termination: str  # stop | length | env_done | max_assistant_turns | max_user_turns | max_tool_calls |
    #                   response_budget | env_error
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    env_rewards: list[float | None] = field(default_factory=list)
    # (response position of the last token of the scored assistant turn, reward) per non-None step reward: where a
    # per-turn reward belongs in token_level_scores
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    conversation: list[dict[str, str]] = field(default_factory=list)  # the episode as chat messages, turn by turn
    tool_errors: Counter = field(default_factory=Counter)
    env_errors: Counter = field(default_factory=Counter)
    env_time_s: float = 0.0
    tool_time_s: float = 0.0
    observations_truncated: int = 0
    failure: str | None = None  # the first tool/environment failure, for the batch error

    @property
    def num_turns(self) -> int:
        return len(self.trajectory.turns)

    def metrics(self) -> dict[str, float]:
        t = self.trajectory
        out = {
            "turns": float(self.num_turns),
            "assistant_turns": float(t.num_assistant_turns),
            "tool_calls": float(len(self.tool_calls)),
            "env_time_s": self.env_time_s,
            "tool_time_s": self.tool_time_s,
            "generated_tokens": float(t.num_generated_tokens),
            "observation_tokens": float(t.num_observation_tokens),
            "observation_token_share": t.num_observation_tokens / max(len(t.response_ids), 1),
            "observations_truncated": float(self.observations_truncated),
        }
        out.update({f"tool_errors/{k}": float(v) for k, v in self.tool_errors.items()})
        out.update({f"env_errors/{k}": float(v) for k, v in self.env_errors.items()})
        return out


def summarize_episodes(episodes: Sequence[Episode]) -> dict[str, float]:
    """Batch metrics: means of per-episode numbers, sums of error counts, termination-reason fractions."""
    n = max(len(episodes), 1)
    out: dict[str, float] = {}
    per = [e.metrics() for e in episodes]
    keys = sorted({k for m in per for k in m})
    for k in keys:
        values = [m.get(k, 0.0) for m in per]
        if "errors/" in k or k == "observations_truncated":
            out[f"agent/{k}"] = float(sum(values))
        else:
            out[f"agent/{k}/mean"] = sum(values) / n
    for reason, count in Counter(e.termination for e in episodes).items():
        out[f"agent/termination/{reason}"] = count / n
    out["agent/reward/mean"] = sum(e.reward for e in episodes) / n
    out["agent/failed_episodes"] = float(sum(e.failure is not None for e in episodes))
    return out


def _messages_of(row: dict[str, Any], index: int) -> list[dict[str, Any]]:
    messages = row.get("raw_prompt", row.get("prompt"))
    if messages is None:
        messages = []
    if hasattr(messages, "tolist"):  # a numpy object array from a DataProto column
        messages = messages.tolist()
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"row {index}: 'raw_prompt' / 'prompt' must be a list of chat messages "
                         f"({{'role': ..., 'content': ...}}), got {type(messages).__name__}")
    return [dict(m) for m in messages]


def _shorten(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def _tools_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    kwargs = row.get("tools_kwargs")
    if kwargs is None:
        kwargs = (row.get("extra_info") or {}).get("tools_kwargs")
    return dict(kwargs or {})


class AgentLoop:
    """Runs episodes over a Generator. `tools`: shared Tool objects (or typed functions); `env_factory`: called once
    per episode; `compute_score`: a reward function over the whole trajectory (veRL's signature)."""

    def __init__(
        self,
        generator: Generator,
        tokenizer: Any,
        config: AgentLoopConfig | None = None,
        tools: Sequence[Any] = (),
        env_factory: Callable[[], Any] | None = None,
        parser: str | ToolCallParser = "hermes",
        compute_score: Callable[..., Any] | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        self.config = config or AgentLoopConfig()
        self.config.validate()
        self.generator = generator
        self.tokenizer = tokenizer
        self.tools = self._index_tools([as_tool(t) for t in tools], "the loop's tools")
        self.env_factory = env_factory
        self.parser = get_parser(parser) if isinstance(parser, str) else parser
        self.compute_score = compute_score
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._seeds = random.Random(self.config.seed)

    @staticmethod
    def _index_tools(tools: list[Tool], where: str) -> dict[str, Tool]:
        out: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in out:
                raise ValueError(f"{where}: two tools are named {tool.name!r}; tool names must be unique")
            out[tool.name] = tool
        return out

    # ------------------------------------------------------------------ batch
    def run_sync(self, rows: Sequence[dict[str, Any]], sampling: SamplingParams | None = None) -> list[Episode]:
        return asyncio.run(self.run(rows, sampling))

    async def run(self, rows: Sequence[dict[str, Any]], sampling: SamplingParams | None = None) -> list[Episode]:
        """One episode per row, concurrently; episodes come back in row order."""
        sampling = sampling or SamplingParams()
        sampling.validate()
        # Turn (episode i, turn t) samples with a seed derived from (base, i, t): reproducible for a given
        # sampling.seed, and fresh for every run() when it is None (as the rollout engines treat seed=None).
        base_seed = sampling.seed if sampling.seed is not None else self._seeds.randrange(2**62)
        limit = asyncio.Semaphore(self.config.max_concurrent_episodes or max(len(rows), 1))
        # hung sync calls must not hold the batch: their daemon threads are abandoned at their timeout (tools.py)
        threads = ToolThreads(self.config.tool_threads)

        async def one(i: int, row: dict[str, Any]) -> Episode:
            async with limit:
                return await _EpisodeRun(self, i, row, sampling, base_seed, threads).run()

        tasks = [asyncio.ensure_future(one(i, dict(r))) for i, r in enumerate(rows)]
        try:
            episodes = await asyncio.gather(*tasks)
        except BaseException:
            # a generator or template error (or a cancellation): stop the other episodes rather than orphan them
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        self._check_failures(episodes)
        return list(episodes)

    def _check_failures(self, episodes: Sequence[Episode]) -> None:
        failed = [e for e in episodes if e.failure is not None]
        if not failed or len(failed) / len(episodes) <= self.config.max_failure_fraction:
            return
        culprits = Counter(e.failure.split(":")[0] for e in failed)  # type: ignore[union-attr]
        first = failed[0]
        raise AgentFailureError(
            f"{len(failed)} of {len(episodes)} episodes failed in a tool or environment "
            f"({len(failed) / len(episodes):.0%} > max_failure_fraction {self.config.max_failure_fraction}); "
            f"first failing sample: row {first.index}: {first.failure}; failures by source: {dict(culprits)}. "
            "Fix the tool/environment, raise its timeout, or raise max_failure_fraction to tolerate it."
        )


class _EpisodeRun:
    """The state of one running episode (kept off the AgentLoop so that episodes share nothing)."""

    def __init__(self, loop: AgentLoop, index: int, row: dict[str, Any], sampling: SamplingParams, base_seed: int,
                 threads: ToolThreads):
        self.loop, self.cfg, self.index, self.row = loop, loop.config, index, row
        self.sampling, self.base_seed, self.threads = sampling, base_seed, threads
        self.single_turn = row.get("agent_name") == SINGLE_TURN_AGENT
        self.tools: dict[str, Tool] = {} if self.single_turn else dict(loop.tools)
        self.states: dict[str, asyncio.Future] = {}
        self.env: Any = None
        self.env_name = "environment"
        self.ep: Episode | None = None
        self.user_turns = 0

    # ------------------------------------------------------------------ helpers
    def _fail(self, source: str, kind: str, error: BaseException | str) -> None:
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if self.ep is not None and self.ep.failure is None:
            self.ep.failure = f"{source}: {kind}: {detail}"

    def _env_failed(self, kind: str, error: BaseException | str) -> str:
        assert self.ep is not None
        self.ep.env_errors[kind] += 1
        self._fail(self.env_name, kind, error)
        return "env_error"

    async def _env_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return await call_maybe_async(getattr(self.env, method), *args, timeout=self.cfg.env_timeout_s,
                                          threads=self.threads, **kwargs)
        finally:
            if self.ep is not None:
                self.ep.env_time_s += time.monotonic() - start

    def _seed(self, turn: int) -> int:
        return ((int(self.base_seed) * 1_000_003 + self.index) * 1_009 + turn) % (2**62)

    # ------------------------------------------------------------------ the episode
    async def run(self) -> Episode:
        messages = _messages_of(self.row, self.index)
        first_obs, env_error, cut = None, None, False
        if self.loop.env_factory is not None and not self.single_turn:
            try:
                self.env = self.loop.env_factory()
                self.env_name = f"environment {type(self.env).__name__}"
                env_tools = self.env.tools() if hasattr(self.env, "tools") else []
                for tool in env_tools:
                    if tool.name in self.tools:
                        raise ValueError(f"its tool {tool.name!r} has the name of a loop tool")
                    self.tools[tool.name] = as_tool(tool)
            except Exception as e:
                env_error = ("construct_raised", e)
        renderer = ChatRenderer(self.loop.tokenizer, [t.schema() for t in self.tools.values()] or None,
                                self.loop.chat_template_kwargs)
        if self.env is not None and env_error is None and hasattr(self.env, "reset"):
            try:
                first_obs = await self._env_call("reset", **self.row)
            except asyncio.TimeoutError:
                env_error = ("reset_timeout", f"reset took longer than env_timeout_s={self.cfg.env_timeout_s}")
            except Exception as e:
                env_error = ("reset_raised", e)
        if first_obs is not None:
            first_obs, cut = renderer.truncate(str(first_obs), self.cfg.max_observation_tokens,
                                                 self.cfg.observation_truncate_side)
            if messages and messages[-1]["role"] == "user":
                messages[-1]["content"] = str(messages[-1].get("content") or "") + first_obs
            else:
                messages.append({"role": "user", "content": first_obs})
        self.ep = ep = Episode(self.index, Trajectory(renderer.prompt_ids(messages)), termination="stop",
                               conversation=[dict(m) for m in messages])
        ep.observations_truncated += int(cut)
        try:
            if env_error is not None:
                ep.env_errors[env_error[0]] += 1
                self._fail(self.env_name, *env_error)
                ep.termination = "env_error"
            else:
                ep.termination = await self._turns(renderer)
            await self._score()
        finally:
            await self._release()  # tool states and the environment are released however the episode ended
        return ep

    async def _turns(self, renderer: ChatRenderer) -> str:
        cfg, ep = self.cfg, self.ep
        assert ep is not None
        traj = ep.trajectory
        has_step = self.env is not None and hasattr(self.env, "step")
        while True:
            if cfg.max_assistant_turns is not None and traj.num_assistant_turns >= cfg.max_assistant_turns:
                return "max_assistant_turns"
            budget = cfg.max_response_tokens - len(traj.response_ids)
            if budget <= 0:
                return "response_budget"
            sampling = dataclasses.replace(self.sampling, seed=self._seed(traj.num_assistant_turns))
            # a generator with sessions keeps this episode's K/V between its turns (agents/engine_generator.py)
            session = {"session": self} if getattr(self.loop.generator, "supports_sessions", False) else {}
            gen = await self.loop.generator.generate(traj.context_ids(), min(cfg.max_tokens_per_turn, budget),
                                                     sampling, **session)
            if not gen.token_ids or len(gen.token_ids) > min(cfg.max_tokens_per_turn, budget):
                raise RuntimeError(f"the generator returned {len(gen.token_ids)} tokens for a turn limited to "
                                   f"{min(cfg.max_tokens_per_turn, budget)} (row {self.index})")
            traj.add_generation(list(gen.token_ids), list(gen.log_probs), gen.finish_reason)
            text = self.loop.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            ep.conversation.append({"role": "assistant", "content": text})
            parsed = self.loop.parser.parse(text) if self.tools else ParsedResponse(text, [])
            user_limit = cfg.max_user_turns is not None and self.user_turns >= cfg.max_user_turns
            # the last turn the limit allows: nothing it asks for is run, since no turn would read the result
            last_turn = cfg.max_assistant_turns is not None and traj.num_assistant_turns >= cfg.max_assistant_turns
            if parsed.calls:
                if user_limit:
                    return "max_user_turns"
                if last_turn:
                    return "max_assistant_turns"
                if cfg.max_tool_calls is not None and len(ep.tool_calls) >= cfg.max_tool_calls:
                    return "max_tool_calls"
                new = await self._run_calls(parsed.calls, traj.num_assistant_turns - 1)
                role = "tool"
            elif has_step:
                try:
                    raw_step = await self._env_call("step", text)
                except asyncio.TimeoutError:
                    return self._env_failed("step_timeout", f"step took longer than env_timeout_s={cfg.env_timeout_s}")
                except Exception as e:
                    return self._env_failed("step_raised", e)
                try:
                    step = read_step(raw_step, self.env_name)
                except TypeError as e:
                    return self._env_failed("bad_step_return", e)
                ep.env_rewards.append(step.reward)
                if step.reward is not None:
                    ep.turn_rewards.append((len(traj.response_ids) - 1, step.reward))
                if step.done:
                    return "env_done"
                if user_limit:
                    return "max_user_turns"
                if last_turn:  # stepped (its reward counts), but no observation is added for a turn that never comes
                    return "max_assistant_turns"
                obs, cut = renderer.truncate(step.observation or "", cfg.max_observation_tokens,
                                              cfg.observation_truncate_side)
                ep.observations_truncated += int(cut)
                new, role = [{"role": "user", "content": obs}], "user"
            else:
                return gen.finish_reason
            stop_id = gen.token_ids[-1] if gen.finish_reason == "stop" else None
            delta = renderer.delta_ids(new, stop_id)
            # The episode must end on an assistant turn: an observation with no room left to answer it is dropped.
            if len(traj.response_ids) + len(delta) >= cfg.max_response_tokens:
                return "response_budget"
            traj.add_observation(delta, role)
            ep.conversation.extend(new)
            self.user_turns += 1

    # ------------------------------------------------------------------ tools
    async def _run_calls(self, calls: list[ToolCall], turn: int) -> list[dict[str, str]]:
        cfg, ep = self.cfg, self.ep
        assert ep is not None
        allowed = len(calls)
        if cfg.max_tool_calls is not None:
            allowed = min(allowed, cfg.max_tool_calls - len(ep.tool_calls))
        allowed = min(allowed, cfg.max_parallel_calls)
        records = await asyncio.gather(*(
            self._call(c, turn) if i < allowed else self._refuse(c, turn, i) for i, c in enumerate(calls)
        ))
        ep.tool_calls.extend(records)  # in the order the model wrote the calls, whatever order they finished in
        return [{"role": "tool", "content": r["output"]} for r in records]

    def _record(self, call: ToolCall, turn: int, error: str | None, output: str, detail: str = "",
                reward: float | None = None, latency: float = 0.0, metrics: dict | None = None) -> dict[str, Any]:
        ep = self.ep
        assert ep is not None
        # An error observation is an observation too: cut like a tool's output, so that it still fits the budget
        # (an observation that does not fit is dropped, and the model would never see what went wrong).
        output, cut = truncate_text(self.loop.tokenizer, output, self.cfg.max_observation_tokens,
                                    side=self.cfg.observation_truncate_side)
        ep.observations_truncated += int(cut)
        if error is not None:
            ep.tool_errors[error] += 1
        name = call.name if isinstance(call.name, str) and call.name else UNPARSED_CALL_NAME
        return {"turn": turn, "name": name, "arguments": call.arguments, "error": error, "detail": detail,
                "output": output, "reward": reward, "latency_s": latency, "truncated": cut,
                "metrics": dict(metrics or {})}

    async def _refuse(self, call: ToolCall, turn: int, i: int) -> dict[str, Any]:
        cfg = self.cfg
        why = (f"at most {cfg.max_parallel_calls} tool calls per turn" if i >= cfg.max_parallel_calls
               else f"the episode's limit of {cfg.max_tool_calls} tool calls is reached")
        return self._record(call, turn, "call_limit", f"Error: tool call not executed: {why}.", why)

    async def _state(self, tool: Tool) -> Any:
        if tool.name not in self.states:
            if has_own(tool, "create"):
                kwargs = dict((_tools_kwargs(self.row).get(tool.name) or {}).get("create_kwargs") or {})
                self.states[tool.name] = asyncio.ensure_future(
                    call_maybe_async(tool.create, timeout=self.cfg.tool_timeout_s, threads=self.threads, **kwargs))
            else:  # Tool's no-op create (a function tool): no state, and no thread to wait for
                self.states[tool.name] = asyncio.get_running_loop().create_future()
                self.states[tool.name].set_result(None)
        return await self.states[tool.name]

    async def _call(self, call: ToolCall, turn: int) -> dict[str, Any]:
        if call.error is not None:
            return self._record(call, turn, call.error, f"Error: could not read the tool call: {call.detail}.",
                                call.detail)
        tool = self.tools.get(call.name or "")
        if tool is None:
            return self._record(call, turn, "unknown_tool",
                                f"Error: unknown tool {call.name!r}; available tools: {sorted(self.tools)}.")
        problem = check_arguments(tool.parameters, call.arguments)
        if problem is not None:
            return self._record(call, turn, "bad_arguments", f"Error: tool {tool.name!r}: {problem}.", problem)
        where = f"tool {tool.name!r}"
        start = time.monotonic()
        try:
            state = await self._state(tool)
        except Exception as e:
            kind = "timeout" if isinstance(e, asyncio.TimeoutError) else "create_raised"
            self._fail(where, kind, e if kind == "create_raised" else f"create() past {self.cfg.tool_timeout_s} s")
            return self._record(call, turn, kind, f"Error: tool {tool.name!r} is unavailable.", str(e))
        execute_kwargs = dict((_tools_kwargs(self.row).get(tool.name) or {}).get("execute_kwargs") or {})
        try:
            raw = await call_maybe_async(tool.execute, state, dict(call.arguments or {}),
                                         timeout=self.cfg.tool_timeout_s, threads=self.threads, **execute_kwargs)
            result = to_tool_result(raw)
            result.text = str(result.text)
        except asyncio.TimeoutError:
            self._fail(where, "timeout", f"no answer within tool_timeout_s={self.cfg.tool_timeout_s}")
            return self._record(call, turn, "timeout",
                                f"Error: tool {tool.name!r} timed out after {self.cfg.tool_timeout_s} s.",
                                latency=time.monotonic() - start)
        except Exception as e:
            self._fail(where, "raised", e)
            message = f"{type(e).__name__}: {str(e)[:500]}"
            shown = f"{type(e).__name__}: {_shorten(str(e), ERROR_TEXT_CHARS)}"
            return self._record(call, turn, "raised", f"Error: tool {tool.name!r} failed: {shown}", message,
                                latency=time.monotonic() - start)
        finally:
            assert self.ep is not None
            self.ep.tool_time_s += time.monotonic() - start
        return self._record(call, turn, None, result.text, reward=result.reward, latency=time.monotonic() - start,
                            metrics=result.metrics)

    async def _release(self) -> None:
        ep = self.ep
        assert ep is not None
        if getattr(self.loop.generator, "supports_sessions", False):
            self.loop.generator.end_session(self)  # type: ignore[attr-defined]  # free the episode's K/V
        for name, future in self.states.items():
            if not future.done() or future.cancelled() or future.exception() is not None:
                continue
            if not has_own(self.tools[name], "release"):  # Tool's no-op release (a function tool): nothing to free
                continue
            try:
                await call_maybe_async(self.tools[name].release, future.result(), timeout=self.cfg.tool_timeout_s,
                                       threads=self.threads)
            except Exception:  # a release failure must not lose the episode; it is counted
                ep.tool_errors["release_raised"] += 1
        if self.env is not None and hasattr(self.env, "close"):
            try:
                await self._env_call("close")
            except Exception:
                ep.env_errors["close_raised"] += 1

    # ------------------------------------------------------------------ rewards
    async def _score(self) -> None:
        ep = self.ep
        assert ep is not None
        env_reward = sum(r for r in ep.env_rewards if r is not None)
        if self.env is not None and ep.termination != "env_error" and hasattr(self.env, "get_reward"):
            try:
                final = await self._env_call("get_reward")
                env_reward += float(final) if final is not None else 0.0
            except Exception as e:
                ep.env_errors["reward_raised"] += 1
                self._fail(self.env_name, "reward_raised", e)
                ep.termination = "env_error"
        tool_reward = sum(c["reward"] for c in ep.tool_calls if c["reward"] is not None)
        ep.reward_parts = parts = {"env": float(env_reward), "tool": float(tool_reward)}
        if self.loop.compute_score is not None:
            parts["score"] = self._user_score()
        total = parts["env"] + parts.get("score", 0.0) + (parts["tool"] if self.cfg.add_tool_rewards else 0.0)
        ep.reward = self.cfg.failure_reward if ep.termination == "env_error" else float(total)

    def _user_score(self) -> float:
        ep = self.ep
        assert ep is not None
        row = self.row
        extra = dict(row.get("extra_info") or {})
        # env_reward: the environment's total (its failure reward if it failed), as the training reward manager
        # passes it (trainer/agent_rewards.py), so one scorer serves both; env_rewards: the per-step rewards
        env_reward = self.cfg.failure_reward if ep.termination == "env_error" else ep.reward_parts["env"]
        extra.update(turns=ep.conversation, tool_calls=ep.tool_calls, num_turns=ep.num_turns,
                     termination=ep.termination, env_rewards=ep.env_rewards, env_reward=env_reward)
        ground_truth = (row.get("reward_model") or {}).get("ground_truth", row.get("ground_truth"))
        solution = self.loop.tokenizer.decode(ep.trajectory.response_ids, skip_special_tokens=True)
        try:
            value = self.loop.compute_score(data_source=row.get("data_source"), solution_str=solution,
                                            ground_truth=ground_truth, extra_info=extra)
        except Exception as e:  # the user's scorer is not an environment: a bug there should stop the run, located
            raise RuntimeError(f"compute_score raised on row {self.index} (data_source "
                               f"{row.get('data_source')!r}): {type(e).__name__}: {e}") from e
        if isinstance(value, dict):
            if "score" not in value:
                raise ValueError(f"compute_score returned a dict without 'score' for row {self.index}: {value!r:.200}")
            value = value["score"]
        return float(value)
