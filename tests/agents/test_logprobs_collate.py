"""Log-probs recorded during real multi-turn sampling (HFGenerator, KV-cache decode) equal one forward pass over
the final trajectory; the collated batch has the rollout layout with multi-turn masks."""

from __future__ import annotations

import pytest
import torch
from agent_helpers import Countdown

from hybridflow.agents import AgentLoop, AgentLoopConfig, HFGenerator, collate_episodes
from hybridflow.engines.rollout.base import SamplingParams


def _episodes(tiny_lm, sampling, n=3, gen=None):
    model, tok = tiny_lm
    gen = gen or HFGenerator(model, [tok.eos_token_id])
    cfg = AgentLoopConfig(max_tokens_per_turn=12, max_response_tokens=120, max_assistant_turns=4, seed=11)
    rows = [{"prompt": [{"role": "user", "content": f"Count {i}."}], "start": i} for i in range(n)]
    return AgentLoop(gen, tok, cfg, env_factory=Countdown).run_sync(rows, sampling)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
                                      SamplingParams(greedy=True)], ids=["sampled", "greedy"])
def test_loop_log_probs_match_a_forward_pass_over_the_trajectory(tiny_lm, sampling):
    model, _ = tiny_lm
    episodes = _episodes(tiny_lm, sampling)
    temperature = 1.0 if sampling.greedy else sampling.temperature
    multi_turn = 0
    for ep in episodes:
        t = ep.trajectory
        multi_turn += t.num_assistant_turns > 1
        ids = torch.tensor([t.context_ids()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        P = len(t.prompt_ids)
        ref = torch.log_softmax(logits[P - 1 : -1] / temperature, -1).gather(-1, ids[0, P:, None]).squeeze(-1)
        mask = torch.tensor(t.response_mask, dtype=torch.bool)
        got = torch.tensor(t.log_probs)
        assert mask.any() and (~mask).any()
        assert torch.allclose(got[mask], ref[mask], atol=1e-5, rtol=0), (got[mask] - ref[mask]).abs().max()
        assert (got[~mask] == 0).all()
    assert multi_turn == len(episodes)  # every episode crossed at least one observation


def test_sampling_is_reproducible_per_episode(tiny_lm):
    gen = HFGenerator(tiny_lm[0], [tiny_lm[1].eos_token_id])  # one generator across two event loops
    a = _episodes(tiny_lm, SamplingParams(temperature=1.0), n=2, gen=gen)
    b = _episodes(tiny_lm, SamplingParams(temperature=1.0), n=2, gen=gen)
    assert [e.trajectory.response_ids for e in a] == [e.trajectory.response_ids for e in b]
    assert a[0].trajectory.response_ids != a[1].trajectory.response_ids
    # one loop, seed=None: every run draws a fresh base seed; an explicit seed repeats
    tok = tiny_lm[1]
    loop = AgentLoop(gen, tok, AgentLoopConfig(max_tokens_per_turn=12, max_assistant_turns=2), env_factory=Countdown)
    rows = [{"prompt": [{"role": "user", "content": "Count."}], "start": 0}]
    runs = [loop.run_sync(rows, SamplingParams(temperature=1.0))[0].trajectory.response_ids for _ in range(2)]
    assert runs[0] != runs[1]
    fixed = [loop.run_sync(rows, SamplingParams(temperature=1.0, seed=5))[0].trajectory.response_ids for _ in range(2)]
    assert fixed[0] == fixed[1]


def test_collate_layout(tiny_lm):
    _, tok = tiny_lm
    episodes = _episodes(tiny_lm, SamplingParams(temperature=1.0), n=3)
    pad = tok.pad_token_id
    batch = collate_episodes(episodes, pad)
    B = len(episodes)
    P = max(len(e.trajectory.prompt_ids) for e in episodes)
    R = max(len(e.trajectory.response_ids) for e in episodes)
    b = batch.batch
    assert b["prompts"].shape == (B, P) and b["responses"].shape == (B, R)
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    for i, ep in enumerate(episodes):
        t = ep.trajectory
        p, r = len(t.prompt_ids), len(t.response_ids)
        assert b["prompts"][i, P - p:].tolist() == t.prompt_ids and (b["prompts"][i, : P - p] == pad).all()
        assert b["responses"][i, :r].tolist() == t.response_ids and (b["responses"][i, r:] == pad).all()
        assert b["attention_mask"][i].tolist() == [0] * (P - p) + [1] * (p + r) + [0] * (R - r)
        assert b["response_mask"][i].tolist() == t.response_mask + [0] * (R - r)
        assert torch.allclose(b["rollout_log_probs"][i, :r], torch.tensor(t.log_probs))
        # positions count real tokens: 0 at the first prompt token, continuing through the response
        pos = b["position_ids"][i]
        assert pos[P - p :].tolist()[: p + r] == list(range(p + r))
    nt = batch.non_tensor_batch
    assert list(nt["num_turns"]) == [e.num_turns for e in episodes]
    assert list(nt["termination"]) == ["env_done"] * B
    assert nt["turn_spans"][0][0]["kind"] == "assistant"
    for i, ep in enumerate(episodes):  # one step reward per assistant turn, at that turn's last generated token
        ends = [s["end"] - 1 for s in nt["turn_spans"][i] if s["kind"] == "assistant"]
        assert [pos for pos, _ in nt["turn_rewards"][i]] == ends
        assert [r for _, r in nt["turn_rewards"][i]] == ep.env_rewards
        assert all(b["response_mask"][i, pos] == 1 for pos in ends)
    assert nt["conversation"][0][0] == {"role": "user", "content": "Count 0. Start at 0."}
    assert batch.meta_info["agent_metrics"]["agent/turns/mean"] == sum(e.num_turns for e in episodes) / B
    with pytest.raises(ValueError, match="no episodes"):
        collate_episodes([], pad)
