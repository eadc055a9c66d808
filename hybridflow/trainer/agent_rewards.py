"""The driver's side of multi-turn rollouts (``actor_rollout_ref.rollout.multi_turn.enable``).

Three small things the step (and validation) do differently when rows are episodes:
  * ``generation_input``: the prompts' non-tensor columns the episodes need travel to the rollout ranks;
  * ``merge_generation``: the episodes' records (num_turns, termination, tool_calls, conversation, ...) join the
    row in ``non_tensor_batch``, next to its tensors;
  * ``AgentRewardFn``: the reward manager scores each row with ``extra_info`` extended by the episode's
    ``turns`` (the conversation), ``tool_calls``, ``num_turns``, ``termination`` and ``env_reward``, then the
    environment's reward is added to the score (``scores``); in ``token_level_scores`` each environment step's reward
    sits on the last token of the turn it scored (``turn_rewards``: per-token credit for GAE), the rest (the final
    ``get_reward``, the user's score, a failure reward) on the last generated token. Row sums are the same either way,
    so outcome estimators (GRPO, RLOO, ...) see the same returns.
    ``reward/env_reward_mean`` and ``reward/user_score_mean`` are logged apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.workers.agent_rollout import ROW_COLUMNS

__all__ = ["AgentRewardFn", "episode_records", "generation_input", "merge_generation"]

# non-tensor columns of an episode (agents/collate.py) that ride on the trained row
EPISODE_COLUMNS = ("num_turns", "termination", "tool_calls", "turn_spans", "conversation", "agent_reward",
                   "agent_reward_parts", "turn_rewards", "agent_metrics", "agent_name")


def generation_input(prompts: DataProto, gen_in: DataProto) -> DataProto:
    """Add the prompts' row columns (raw_prompt, data_source, extra_info, ...) to the rollout's input."""
    for key in ROW_COLUMNS:
        if key in prompts.non_tensor_batch:
            gen_in.non_tensor_batch[key] = prompts.non_tensor_batch[key]
    return gen_in


def merge_generation(rows: DataProto, gen: DataProto) -> DataProto:
    """The episode columns of `gen` onto `rows` (same order: sample j of prompt i at row i*n+j)."""
    for key in EPISODE_COLUMNS:
        if key in gen.non_tensor_batch:
            rows.non_tensor_batch[key] = gen.non_tensor_batch[key]
    return rows


def episode_records(batch: DataProto) -> list[dict[str, Any]] | None:
    """Per row, what samples.jsonl keeps of its episode (None when the rows are not episodes)."""
    nt = batch.non_tensor_batch
    if "conversation" not in nt:
        return None
    names = nt.get("agent_name")
    return [{"conversation": list(nt["conversation"][i]), "num_turns": int(nt["num_turns"][i]),
             "termination": str(nt["termination"][i]),
             **({"agent_name": names[i]} if names is not None and names[i] is not None else {}),
             "tool_calls": [{"name": c.get("name"), "arguments": c.get("arguments"), "error": c.get("error")}
                            for c in nt["tool_calls"][i]]} for i in range(len(batch))]


def _extra_info(batch: DataProto) -> np.ndarray:
    nt = batch.non_tensor_batch
    base = nt.get("extra_info", [None] * len(batch))
    out = np.empty(len(batch), dtype=object)
    for i in range(len(batch)):
        info = dict(base[i] or {})
        info.update(turns=list(nt["conversation"][i]), tool_calls=list(nt["tool_calls"][i]),
                    num_turns=int(nt["num_turns"][i]), termination=str(nt["termination"][i]),
                    env_reward=float(nt["agent_reward"][i]))
        out[i] = info
    return out


def place_turn_rewards(token_scores: torch.Tensor, mask: torch.Tensor, turn_rewards: Any, terminations: Any,
                       rows: torch.Tensor) -> torch.Tensor:
    """Add each step reward of `turn_rewards` (per row: [(response position, reward), ...]) to `token_scores
    [B, R]` at its position; returns ``[B]`` what was placed (0 for rows without, or whose environment failed: their
    failure reward replaces the steps' rewards). A position past the row's generated tokens goes to the last one."""
    placed = torch.zeros(token_scores.shape[0], dtype=token_scores.dtype)
    if turn_rewards is None:
        return placed
    for i in rows.tolist():
        if str(terminations[i]) == "env_error":
            continue
        entries = turn_rewards[i]
        for position, reward in (() if entries is None else entries):
            position = int(position)
            if 0 <= position < mask.shape[1] and mask[i, position]:
                token_scores[i, position] += float(reward)
                placed[i] += float(reward)
    return placed


class AgentRewardFn:
    """Wraps a reward manager: episode records in extra_info for compute_score, plus the environment's reward.
    Rows without episode columns are scored as they are."""

    def __init__(self, reward_fn: Any):
        self.reward_fn = reward_fn

    def __getattr__(self, name: str) -> Any:  # close(), total_failures, ... of the wrapped manager
        return getattr(self.reward_fn, name)

    def __call__(self, batch: DataProto, **kwargs: Any) -> Any:
        nt = batch.non_tensor_batch
        if "agent_reward" not in nt:
            return self.reward_fn(batch, **kwargs)
        saved = nt.get("extra_info")
        nt["extra_info"] = _extra_info(batch)
        try:
            result = self.reward_fn(batch, **kwargs)
        finally:  # the row keeps its own extra_info (the episode records already ride in their own columns)
            if saved is None:
                nt.pop("extra_info")
            else:
                nt["extra_info"] = saved
        env = torch.tensor([float(r) for r in nt["agent_reward"]], dtype=torch.float32)
        result.metrics["reward/user_score_mean"] = float(result.scores.mean()) if len(env) else 0.0
        result.metrics["reward/env_reward_mean"] = float(env.mean()) if len(env) else 0.0
        result.scores = result.scores + env
        mask = batch.batch["response_mask"].cpu()
        has = mask.any(-1)
        last = (mask.shape[1] - 1) - mask.flip(-1).long().argmax(-1)  # the last generated token of each row
        rows = torch.nonzero(has, as_tuple=True)[0]
        placed = place_turn_rewards(result.token_level_scores, mask, nt.get("turn_rewards"), nt["termination"], rows)
        result.token_level_scores[rows, last[rows]] += env[rows] - placed[rows]
        result.metrics["reward/score_mean"] = float(result.scores.mean()) if len(env) else 0.0
        return result
