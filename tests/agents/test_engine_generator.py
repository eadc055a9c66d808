"""The loop over the project's rollout engines (native, hf) through RolloutEngineGenerator: turns of concurrent
episodes share engine calls, and the recorded log-probs match a forward pass over the final trajectories."""

from __future__ import annotations

import pytest
import torch
from agent_helpers import Countdown

from hybridflow.agents import AgentLoop, AgentLoopConfig
from hybridflow.agents.engine_generator import RolloutEngineGenerator
from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.engines.rollout.registry import create_rollout_engine


@pytest.mark.parametrize("engine_name,keep_kv", [("native", None), ("native", False), ("hf", None)],
                         ids=["native-sessions", "native-reprefill", "hf"])
@pytest.mark.parametrize("sampling", [SamplingParams(greedy=True), SamplingParams(temperature=0.8, top_k=30)],
                         ids=["greedy", "sampled"])
def test_engine_generator_batches_turns_and_log_probs_match(tiny_lm, tiny_model_path, engine_name, keep_kv,
                                                            sampling):
    model, tok = tiny_lm
    engine = create_rollout_engine(engine_name, tiny_model_path, dtype="fp32", seed=0, num_threads=1)
    gen = RolloutEngineGenerator(engine, keep_kv=keep_kv)
    assert gen.supports_sessions == (engine_name == "native" and keep_kv is None)
    cfg = AgentLoopConfig(max_tokens_per_turn=10, max_response_tokens=150, max_assistant_turns=4)
    rows = [{"prompt": [{"role": "user", "content": f"Count {i}."}], "start": i} for i in range(4)]
    episodes = AgentLoop(gen, tok, cfg, env_factory=Countdown).run_sync(rows, sampling)
    assert gen.requests == sum(e.trajectory.num_assistant_turns for e in episodes)
    if gen.supports_sessions:  # turns of different episodes decoded in one batch, and histories were kept
        assert gen.stats["max_running_rows"] > 1 and gen.stats["reused_tokens"] > 0
    else:
        assert gen.calls < gen.requests  # turns of different episodes went through the engine together
    temperature = 1.0 if sampling.greedy else sampling.temperature
    for ep in episodes:
        t = ep.trajectory
        assert t.num_assistant_turns > 1 and all(len(t.response_ids[s.start:s.end]) <= 10 for s in t.turns
                                                 if s.kind == "assistant")
        ids = torch.tensor([t.context_ids()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        P = len(t.prompt_ids)
        ref = torch.log_softmax(logits[P - 1 : -1] / temperature, -1).gather(-1, ids[0, P:, None]).squeeze(-1)
        mask = torch.tensor(t.response_mask, dtype=torch.bool)
        err = (torch.tensor(t.log_probs)[mask] - ref[mask]).abs().max().item()
        assert err <= 1e-5, err
