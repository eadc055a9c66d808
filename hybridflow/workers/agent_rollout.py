"""Multi-turn rollouts in the rollout worker: ``actor_rollout_ref.rollout.multi_turn`` (veRL's keys) -> AgentLoop.

With ``multi_turn.enable=true`` a rollout rank runs one episode per (prompt, sample) through ``hybridflow.agents``
over its own rollout engine (native, hf, vllm: ``RolloutEngineGenerator``) and returns the batch in the rollout
layout of engines/rollout/base.py, so the rest of the step does not change:

  ``prompts [B*n, P]`` left-padded to ``data.max_prompt_length`` (the same width on every rank),
  ``responses [B*n, R]`` right-padded to ``data.max_response_length``, ``input_ids``, ``attention_mask`` (1 on
  generated and observation tokens), ``position_ids``, ``response_mask`` (1 only on generated tokens: the loss,
  advantages, KL and entropy skip observations), ``rollout_log_probs`` (0 on observations);
  non_tensor_batch: ``num_turns``, ``termination``, ``tool_calls``, ``turn_spans``, ``conversation``,
  ``agent_reward`` (the environment's reward), ``agent_metrics`` (per episode), see agents/collate.py.

Sample j of prompt i is row ``i*n + j``, as with single-turn generation. A row's ``agent_name`` column (veRL's) picks
its agent loop: ``tool_agent`` (the episode above) or ``single_turn_agent`` (one generation, no tools, no
environment); rows without one take ``rollout.agent.default_agent_loop`` (None: ``tool_agent`` when
``multi_turn.enable=true``, else ``single_turn_agent``, and then the plain single-turn rollout runs). The episode's
rows come from the prompt's non-tensor columns (``raw_prompt`` — hence ``data.return_raw_chat=true`` —,
``data_source``, ``extra_info``, ``reward_model``, ``tools_kwargs``, ``agent_name``). The user's ``compute_score``
is not run here but by the driver's reward manager, which sees the episode's turns and tool calls in
``extra_info`` (trainer/agent_rewards.py).

Key mapping (veRL's names; hybridflow's additions marked +):
  max_assistant_turns, max_user_turns, max_parallel_calls -> the loop's limits of the same names;
  max_tool_response_length -> max_observation_tokens (in tokens here; veRL counts characters);
  tool_response_truncate_side -> observation_truncate_side; format -> the tool-call parser;
  tool_config_path -> veRL tool classes; + tools: ``module:function`` typed functions;
  + environment / environment_kwargs: a registered environment or ``module:Class``;
  + max_tool_calls, max_tokens_per_turn (None: the whole budget), tool_timeout_s, env_timeout_s,
  max_failure_fraction, failure_reward; the episode's token budget is ``data.max_response_length``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch

from hybridflow.agents import AgentLoop, AgentLoopConfig, RolloutEngineGenerator, collate_episodes, get_parser
from hybridflow.agents.adapters import load_verl_tool_config
from hybridflow.agents.builtin import environment_factory
from hybridflow.agents.engine_generator import STOP
from hybridflow.agents.loop import SINGLE_TURN_AGENT
from hybridflow.agents.trajectory import TRUNCATE_SIDES
from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.engines.rollout.layout import pad_responses
from hybridflow.plugins import import_object
from hybridflow.protocol import DataProto

__all__ = [
    "AGENT_LOOPS",
    "AgentRollout",
    "TensorParallelLink",
    "agent_batch_metrics",
    "agent_loop_config",
    "agent_name_errors",
    "default_agent_loop",
    "multi_turn_config_errors",
    "multi_turn_tools",
]

# the prompt's non-tensor columns an episode reads (others stay on the driver's copy of the batch)
ROW_COLUMNS = ("raw_prompt", "data_source", "extra_info", "reward_model", "ground_truth", "tools_kwargs", "index",
               "agent_name")
TOOL_AGENT = "tool_agent"
AGENT_LOOPS = (SINGLE_TURN_AGENT, TOOL_AGENT)  # veRL's agent loop names that hybridflow runs


def default_agent_loop(rollout: Any) -> str:
    """The agent loop of a row with no agent_name: rollout.agent.default_agent_loop, or by multi_turn.enable."""
    return rollout.agent.default_agent_loop or (TOOL_AGENT if rollout.multi_turn.enable else SINGLE_TURN_AGENT)


def _agent_loop_errors(rollout: Any) -> list[str]:
    key = "actor_rollout_ref.rollout.agent.default_agent_loop"
    name = rollout.agent.default_agent_loop
    if name is not None and name not in AGENT_LOOPS:
        return [f"{key}={name!r}: hybridflow runs veRL's {' and '.join(AGENT_LOOPS)} (a custom agent loop is an "
                "environment here: actor_rollout_ref.rollout.multi_turn.environment=package.module:Class)"]
    if name == TOOL_AGENT and not rollout.multi_turn.enable:
        return [f"{key}=tool_agent needs actor_rollout_ref.rollout.multi_turn.enable=true and its tools or "
                "environment"]
    return []


def agent_name_errors(cfg: Any, counts: dict[str, int], where: str) -> list[str]:
    """The data's agent_name values (`counts`: value -> rows, "None" for rows without one) that cannot run."""
    rollout = cfg.actor_rollout_ref.rollout
    named = {k: c for k, c in counts.items() if k != "None"}
    unknown = {k: c for k, c in named.items() if k not in AGENT_LOOPS}
    errors = []
    if unknown:
        listed = ", ".join(f"{k!r} ({c} rows)" for k, c in sorted(unknown.items()))
        errors.append(f"{where}: column 'agent_name' names agent loop(s) {listed}; hybridflow runs veRL's "
                      f"{' and '.join(AGENT_LOOPS)} (an agent of your own is an environment here: "
                      "actor_rollout_ref.rollout.multi_turn.environment=package.module:Class)")
    if named.get(TOOL_AGENT) and not rollout.multi_turn.enable:
        errors.append(f"{where}: {named[TOOL_AGENT]} rows have agent_name 'tool_agent', which needs "
                      "actor_rollout_ref.rollout.multi_turn.enable=true with tools (tool_config_path / tools) or an "
                      "environment")
    return errors


def agent_loop_config(mt: Any, max_response_length: int, seed: int = 0) -> AgentLoopConfig:
    """The multi_turn section (+ the response budget) as the loop's limits."""
    return AgentLoopConfig(
        max_assistant_turns=mt.max_assistant_turns,
        max_user_turns=mt.max_user_turns,
        max_tool_calls=mt.max_tool_calls,
        max_parallel_calls=mt.max_parallel_calls,
        max_response_tokens=max_response_length,
        max_tokens_per_turn=min(mt.max_tokens_per_turn or max_response_length, max_response_length),
        max_observation_tokens=mt.max_tool_response_length,
        observation_truncate_side=mt.tool_response_truncate_side,
        tool_timeout_s=mt.tool_timeout_s,
        env_timeout_s=mt.env_timeout_s,
        max_failure_fraction=mt.max_failure_fraction,
        failure_reward=mt.failure_reward,
        seed=seed,
    )


def multi_turn_tools(mt: Any) -> list[Any]:
    """The tools of the section: veRL's tool config file, then ``tools`` (``module:function`` paths)."""
    tools: list[Any] = []
    if mt.tool_config_path:
        tools += load_verl_tool_config(mt.tool_config_path)
    for i, path in enumerate(mt.tools or []):
        tools.append(import_object(str(path), what=f"actor_rollout_ref.rollout.multi_turn.tools[{i}]"))
    return tools


def multi_turn_config_errors(cfg: Any) -> list[str]:
    """Start-up checks of the multi_turn section (each message names the key); [] when it is off or fine. Loads the
    tool config file and the environment, so a missing class fails here, before any process starts."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    key = "actor_rollout_ref.rollout.multi_turn"
    errors = _agent_loop_errors(cfg.actor_rollout_ref.rollout)
    if not mt.enable:
        set_keys = [k for k in ("tool_config_path", "environment") if getattr(mt, k)] + (["tools"] if mt.tools else [])
        return errors + [f"{key}.{k} is set but {key}.enable=false; set enable=true to run multi-turn episodes, or "
                         "remove it" for k in set_keys]
    if not cfg.data.return_raw_chat:
        errors.append(f"{key}.enable=true needs data.return_raw_chat=true (episodes are rendered from the chat "
                      "messages, as in veRL)")
    if mt.tool_response_truncate_side not in TRUNCATE_SIDES:
        errors.append(f"{key}.tool_response_truncate_side={mt.tool_response_truncate_side!r}: choose one of "
                      f"{list(TRUNCATE_SIDES)}")
    else:
        try:
            agent_loop_config(mt, cfg.data.max_response_length).validate()
        except ValueError as e:
            errors.append(f"{key}: {e}")
    try:
        get_parser(mt.format)
    except Exception as e:
        errors.append(f"{key}.format={mt.format!r}: {e}")
    try:
        multi_turn_tools(mt)
    except Exception as e:
        errors.append(f"{key}: {e}")
    if mt.environment:
        try:
            environment_factory(mt.environment, mt.environment_kwargs)
        except Exception as e:
            errors.append(f"{key}.environment={mt.environment!r}: {e}")
        else:
            errors += _environment_kwargs_errors(mt.environment, dict(mt.environment_kwargs or {}), key)
    elif mt.environment_kwargs:
        errors.append(f"{key}.environment_kwargs is set without {key}.environment")
    if not mt.environment and not mt.tools and not mt.tool_config_path:
        errors.append(f"{key}.enable=true with neither tools (tool_config_path / tools) nor an environment: "
                      "episodes would be single-turn; configure one, or set enable=false")
    return errors


def _environment_kwargs_errors(name: str, kwargs: dict[str, Any], key: str) -> list[str]:
    """environment_kwargs that the environment's constructor does not take (a preset's kwargs left over when the
    environment is changed; a misspelled name): found from its signature here, not in every episode after start."""
    import inspect

    from hybridflow.agents.builtin import ENVIRONMENTS

    entry = ENVIRONMENTS.get(name)
    try:
        signature = inspect.signature(entry)
    except (TypeError, ValueError):
        return []  # a constructor without a signature to read: its episodes say it
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        return [f"{key}.environment_kwargs={kwargs}: {getattr(entry, '__name__', name)}{signature} does not take them "
                f"({e}); fix the names, or drop a preset's entry with ~{key}.environment_kwargs.<name> (Hydra's "
                f"deletion; ~{key}.environment_kwargs drops them all)"]
    return []


class TensorParallelLink:
    """A tensor-parallel rollout group's channel for the agent loop: the first rank `send`s its engine ops, the others
    `receive` them (torch.distributed.broadcast_object_list over a CPU group of the group's ranks)."""

    def __init__(self, group: Any, first_rank: int, leader: bool):
        self.group, self.first_rank, self.leader = group, first_rank, leader

    def send(self, ops: list[tuple]) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([ops], src=self.first_rank, group=self.group)

    def receive(self) -> list[tuple]:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.first_rank, group=self.group)
        return box[0]


class AgentRollout:
    """One rank's agent loop over its rollout engine; `generate` has the engine's signature."""

    def __init__(self, cfg: Any, engine: Any, tokenizer: Any, tensor_parallel: TensorParallelLink | None = None):
        mt = cfg.actor_rollout_ref.rollout.multi_turn
        # a tensor-parallel group: its first rank runs the episodes, the others replay its engine ops (mirror/follow)
        self.tp = tensor_parallel
        self.max_prompt_length = int(cfg.data.max_prompt_length)
        self.max_response_length = int(cfg.data.max_response_length)
        self.engine = engine
        self.default_agent = default_agent_loop(cfg.actor_rollout_ref.rollout)
        self.pad_token_id = int(getattr(engine, "pad_token_id", None) or tokenizer.pad_token_id or 0)
        env_name, env_kwargs = mt.environment, mt.environment_kwargs
        env_factory = environment_factory(env_name, env_kwargs) if env_name else None
        cap = cfg.actor_rollout_ref.rollout.max_num_seqs  # veRL's decode batch cap: the turns batched at once too
        self.loop = AgentLoop(
            RolloutEngineGenerator(engine, **({"max_batch_size": int(cap)} if cap is not None else {}),
                                   mirror=self.tp.send if self.tp is not None and self.tp.leader else None),
            tokenizer,
            agent_loop_config(mt, self.max_response_length, seed=cfg.trainer.seed),
            tools=multi_turn_tools(mt),
            env_factory=env_factory,
            parser=mt.format,
            chat_template_kwargs=dict(cfg.data.apply_chat_template_kwargs or {}),
        )

    @classmethod
    def from_config(cls, cfg: Any, engine: Any, model_path: str,
                    tensor_parallel: TensorParallelLink | None = None) -> AgentRollout:
        from transformers import AutoTokenizer

        return cls(cfg, engine, AutoTokenizer.from_pretrained(os.fspath(model_path)), tensor_parallel)

    def rows(self, prompts: DataProto, n: int) -> list[dict[str, Any]]:
        nt = prompts.non_tensor_batch
        if "raw_prompt" not in nt:
            raise ValueError("multi-turn rollout: the prompts carry no 'raw_prompt' column; set "
                             "data.return_raw_chat=true")
        columns = [c for c in ROW_COLUMNS if c in nt]
        rows = [{c: nt[c][i] for c in columns} for i in range(len(prompts))]
        for r in rows:
            r["agent_name"] = r.get("agent_name") or self.default_agent
        return [dict(r) for r in rows for _ in range(n)]  # sample j of prompt i at row i*n + j

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto | None:
        """prompts (with the non-tensor columns above) -> len(prompts) * params.n episodes in the rollout layout.
        In a tensor-parallel group every rank calls it with the same prompts; the first rank returns the batch (the
        group's collector), the others None once they have replayed its engine ops."""
        if self.tp is None:
            return self._generate(prompts, params)
        if not self.tp.leader:
            error = self.loop.generator.follow(self.tp.receive)
            if error is not None:
                raise RuntimeError(f"the tensor-parallel group's first rank failed its episodes: {error}")
            return None
        try:
            out = self._generate(prompts, params)
        except BaseException as e:
            self.tp.send([(STOP, f"{type(e).__name__}: {e}")])
            raise
        self.tp.send([(STOP, None)])
        return out

    def _generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        rows = self.rows(prompts, params.n)
        sampling = dataclasses.replace(params, n=1, max_new_tokens=self.max_response_length)
        episodes = self.loop.run_sync(rows, sampling)
        out = collate_episodes(episodes, self.pad_token_id)
        out.non_tensor_batch["agent_name"] = np.array([r["agent_name"] for r in rows], dtype=object)  # as resolved
        out = _left_pad_prompts(out, self.max_prompt_length, self.pad_token_id)
        return pad_responses(out, self.max_response_length, self.pad_token_id)


def _left_pad_prompts(out: DataProto, width: int, pad_token_id: int) -> DataProto:
    """Left-pad the prompt part to `width` columns (every rank's rows must gather into one batch); a prompt the
    environment's first observation made longer than that is an error naming the key."""
    b = out.batch
    prompt_len = b["prompts"].shape[1]
    if prompt_len > width:
        raise ValueError(f"multi-turn rollout: an episode's prompt has {prompt_len} tokens (with the environment's first "
                         f"observation) > data.max_prompt_length={width}; raise data.max_prompt_length")
    extra = width - prompt_len
    if extra == 0:
        return out
    rows = b["prompts"].shape[0]

    def left(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t.new_full((rows, extra), value), t], dim=1)

    R = b["responses"].shape[1]
    b["prompts"] = left(b["prompts"], pad_token_id)
    b["input_ids"] = left(b["input_ids"], pad_token_id)
    b["attention_mask"] = left(b["attention_mask"], 0)
    mask = b["attention_mask"]
    # positions count real tokens only, so padding columns change nothing (0 on the padding itself)
    b["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    b["position_ids"][:, -R:] = b["position_ids"][:, width - 1: width] + 1 + torch.arange(R)[None, :]
    return out


def agent_batch_metrics(batch: DataProto, scores: torch.Tensor | None = None) -> dict[str, float]:
    """Driver side: the step's agent metrics from the rows' own records (agents.summarize_episodes' names);
    with the rows' `scores` [B], also the solved fraction (score > 0) and the turns of solved episodes."""
    nt = batch.non_tensor_batch
    if "agent_metrics" not in nt:
        return {}
    per = [dict(m) for m in nt["agent_metrics"]]
    n = max(len(per), 1)
    out: dict[str, float] = {}
    for k in sorted({k for m in per for k in m}):
        values = [float(m.get(k, 0.0)) for m in per]
        if "errors/" in k or k == "observations_truncated":
            out[f"agent/{k}"] = float(sum(values))
        else:
            out[f"agent/{k}/mean"] = sum(values) / n
    reasons, counts = np.unique(np.asarray([str(t) for t in nt["termination"]]), return_counts=True)
    for reason, count in zip(reasons, counts):
        out[f"agent/termination/{reason}"] = float(count) / n
    for calls in nt.get("tool_calls", []):
        for call in calls:  # calls by tool name, summed over the batch
            key = f"agent/tool_calls_by_name/{call.get('name')}"
            out[key] = out.get(key, 0.0) + 1
    if "agent_reward" in nt:
        env_rewards = [float(r) for r in nt["agent_reward"]]
        out["agent/env_reward/mean"] = float(np.mean(env_rewards))
        # episodes given the full reward 1: a won game where the environment pays partial rewards for losses
        # (textarena's GuessTheNumber pays closeness), so "score > 0" (solved_fraction) is not the win rate there
        out["agent/env_reward_full_fraction"] = float(np.mean([r >= 1.0 for r in env_rewards]))
    if scores is not None and len(per):
        solved = (scores.detach().cpu().float() > 0).tolist()
        out["agent/solved_fraction"] = sum(solved) / n
        turns = [m.get("assistant_turns", 0.0) for m, s in zip(per, solved) if s]
        if turns:
            out["agent/assistant_turns_when_solved/mean"] = sum(turns) / len(turns)
    return out
