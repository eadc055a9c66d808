"""Episodes -> one DataProto in the rollout layout of engines/rollout/base.py, with multi-turn masks.

Tensors (B episodes, P = longest prompt, R = longest response, at least 1):
  ``prompts [B, P]`` left-padded, ``responses [B, R]`` right-padded with pad_token_id,
  ``input_ids [B, P+R]`` = cat(prompts, responses),
  ``attention_mask [B, P+R]``: 1 on every real token, generated or observation (the model attends to both),
  ``position_ids [B, P+R]``: 0.. over the prompt's real tokens, continuing through the response,
  ``response_mask [B, R]``: 1 on model-generated tokens only (0 on observations and padding): the loss,
     advantages, KL and entropy use it, so observation tokens are never trained on,
  ``rollout_log_probs [B, R]``: the generator's log-probs on generated tokens, 0 elsewhere.
non_tensor_batch: ``num_turns``, ``termination``, ``tool_calls`` (list of call records), ``turn_spans`` (assistant /
observation spans in response positions), ``conversation`` (the episode as chat messages), ``agent_reward`` and
``agent_reward_parts``, ``turn_rewards`` ((response position, reward) of each environment step reward, at the
scored turn's last token), ``agent_metrics`` (per-episode numbers); meta_info ``agent_metrics`` (batch summary).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from hybridflow.agents.loop import Episode, summarize_episodes
from hybridflow.protocol import DataProto

__all__ = ["collate_episodes"]


def collate_episodes(episodes: Sequence[Episode], pad_token_id: int) -> DataProto:
    if not episodes:
        raise ValueError("collate_episodes got no episodes")
    B = len(episodes)
    P = max(len(e.trajectory.prompt_ids) for e in episodes)
    R = max(max(len(e.trajectory.response_ids) for e in episodes), 1)
    prompts = torch.full((B, P), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    responses = torch.full((B, R), pad_token_id, dtype=torch.long)
    response_attn = torch.zeros((B, R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.long)
    log_probs = torch.zeros((B, R), dtype=torch.float32)
    for i, e in enumerate(episodes):
        t = e.trajectory
        p, r = len(t.prompt_ids), len(t.response_ids)
        if p:
            prompts[i, P - p:] = torch.tensor(t.prompt_ids)
            prompt_mask[i, P - p:] = 1
        if r:
            responses[i, :r] = torch.tensor(t.response_ids)
            response_attn[i, :r] = 1
            response_mask[i, :r] = torch.tensor(t.response_mask)
            log_probs[i, :r] = torch.tensor(t.log_probs, dtype=torch.float32)
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    response_pos = prompt_pos[:, -1:] + 1 + torch.arange(R)[None, :]
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_attn], dim=1),
        "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
    }
    non_tensors = {
        "num_turns": [e.num_turns for e in episodes],
        "termination": [e.termination for e in episodes],
        "tool_calls": [list(e.tool_calls) for e in episodes],
        "turn_spans": [[dataclasses.asdict(s) for s in e.trajectory.turns] for e in episodes],
        "conversation": [list(e.conversation) for e in episodes],
        "agent_reward": [float(e.reward) for e in episodes],
        "agent_reward_parts": [dict(e.reward_parts) for e in episodes],
        "turn_rewards": [list(e.turn_rewards) for e in episodes],
        "agent_metrics": [e.metrics() for e in episodes],
    }
    return DataProto.from_dict(tensors, non_tensors, {"agent_metrics": summarize_episodes(episodes)})
