"""Environment step rewards sit on the token of the turn they scored; the row's total is unchanged."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.engines.tiny import build_char_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardManager
from hybridflow.trainer.agent_rewards import AgentRewardFn


def _episodes(tokenizer) -> DataProto:
    """Two episodes of 12 response positions: generated 0-3, observation 4-7, generated 8-10, padding 11."""
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0]] * 2)
    ids = torch.where(mask.bool(), torch.tensor(tokenizer.convert_tokens_to_ids("7")), tokenizer.pad_token_id)
    nt = {
        "data_source": ["hybridflow/arithmetic"] * 2, "reward_model": [{"ground_truth": "7"}] * 2,
        "extra_info": [{}, {}], "conversation": [[], []], "tool_calls": [[], []], "num_turns": [2, 2],
        # step rewards 0.25 (turn 1, last token 3) and 0.5 (turn 2, last token 10); get_reward added 1.0 on top
        "turn_rewards": [[(3, 0.25), (10, 0.5)], [(3, 0.25), (10, 0.5)]],
        "agent_reward": [1.75, -1.0], "termination": ["done", "env_error"],  # row 1: its failure reward only
    }
    return DataProto.from_dict({"responses": ids, "response_mask": mask}, {k: np.array(v, dtype=object) if k in (
        "turn_rewards", "conversation", "tool_calls", "extra_info", "reward_model") else v for k, v in nt.items()})


def test_step_rewards_on_their_turns_and_the_rest_on_the_last_token():
    tokenizer = build_char_tokenizer()
    with RewardManager(tokenizer, compute_score=lambda *a, **k: 0.0, num_workers=0) as rm:
        result = AgentRewardFn(rm)(_episodes(tokenizer))
    tls = result.token_level_scores
    assert tls[0, 3] == 0.25 and tls[0, 10] == 0.5 + 1.0  # the final get_reward on the last generated token
    assert torch.count_nonzero(tls[0]) == 2
    assert tls[1, 10] == -1.0 and torch.count_nonzero(tls[1]) == 1  # env_error: the failure reward, no steps
    assert torch.allclose(tls.sum(-1), result.scores) and result.scores.tolist() == [1.75, -1.0]
