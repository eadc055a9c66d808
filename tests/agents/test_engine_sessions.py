"""The agent loop over the native engine's sessions (K/V kept between turns): the same episodes as the HFGenerator
reference (greedy, and sampled: the same per-turn random streams), rollout log-probs equal to the training engine's
one forward over the final trajectories (fp32, 1e-5), and every episode's K/V freed when it ends."""

from __future__ import annotations

import pytest
from agent_helpers import Countdown

from hybridflow.agents import AgentLoop, AgentLoopConfig, HFGenerator, collate_episodes
from hybridflow.agents.engine_generator import RolloutEngineGenerator
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.engines.rollout.registry import create_rollout_engine

CFG = AgentLoopConfig(max_tokens_per_turn=10, max_response_tokens=150, max_assistant_turns=4, seed=3)
ROWS = [{"prompt": [{"role": "user", "content": f"Count {i}."}], "start": i} for i in range(4)]


@pytest.mark.parametrize("sampling", [SamplingParams(greedy=True), SamplingParams(temperature=0.8, top_k=30,
                                                                                 top_p=0.95, seed=7)],
                         ids=["greedy", "sampled"])
def test_kept_kv_episodes_equal_the_reference_and_log_probs_the_training_engine(tiny_lm, tiny_model_path, sampling):
    model, tok = tiny_lm
    engine = create_rollout_engine("native", tiny_model_path, dtype="fp32", seed=0, num_threads=1)
    gen = RolloutEngineGenerator(engine, max_cached_tokens=4096)
    episodes = AgentLoop(gen, tok, CFG, env_factory=Countdown).run_sync(ROWS, sampling)
    reference = AgentLoop(HFGenerator(model, [tok.eos_token_id]), tok, CFG, env_factory=Countdown).run_sync(
        ROWS, sampling)
    assert [e.trajectory.context_ids() for e in episodes] == [e.trajectory.context_ids() for e in reference]
    assert all(e.trajectory.num_assistant_turns > 1 for e in episodes)
    stats = gen.stats
    assert stats["reused_tokens"] > stats["prefill_tokens"] and stats["max_running_rows"] > 1, stats
    assert gen.sessions.memory()["parked_sessions"] == 0  # end_session freed every episode's K/V

    batch = collate_episodes(episodes, engine.pad_token_id)
    train = FSDPEngine(EngineConfig(model_path=tiny_model_path, role="ref", optim=OptimConfig(lr=1e-3),
                                    micro_batch_size_per_gpu=4))
    temperature = 1.0 if sampling.greedy else sampling.temperature
    log_probs = train.compute_log_prob(batch, temperature=temperature)["log_probs"]
    mismatch = logprob_mismatch(batch.batch["rollout_log_probs"], log_probs, batch.batch["response_mask"])
    assert mismatch["mismatch/max_abs"] <= 1e-5, mismatch


def test_a_turn_past_the_token_cap_fails_the_run_with_the_numbers_and_the_generator_recovers(tiny_lm, tiny_model_path):
    """A cap that holds one first turn at a time: the other episodes' turns wait for it (never a hang); a later turn
    that cannot fit even alone is an error naming the cap; the same generator then serves the next run."""
    from hybridflow.engines.rollout.sessions import SessionMemoryError

    _, tok = tiny_lm
    engine = create_rollout_engine("native", tiny_model_path, dtype="fp32", seed=0, num_threads=1)
    gen = RolloutEngineGenerator(engine, max_cached_tokens=64)
    one_turn = AgentLoopConfig(max_tokens_per_turn=10, max_assistant_turns=1)
    episodes = AgentLoop(gen, tok, one_turn, env_factory=Countdown).run_sync(ROWS, SamplingParams(greedy=True))
    assert all(e.trajectory.num_generated_tokens == 10 for e in episodes)
    assert gen.stats["max_running_rows"] == 1  # each first turn reserves 45+ of the 64 tokens: one at a time
    with pytest.raises(SessionMemoryError, match="max_cached_tokens=64"):
        AgentLoop(gen, tok, CFG, env_factory=Countdown).run_sync(ROWS[:2], SamplingParams(greedy=True))
    again = AgentLoop(gen, tok, one_turn, env_factory=Countdown).run_sync(ROWS[:2], SamplingParams(greedy=True))
    assert [e.trajectory.response_ids for e in again] == [e.trajectory.response_ids for e in episodes[:2]]


def test_an_engine_error_fails_the_turns_it_holds_and_the_next_call_works(tiny_model_path):
    """A token id past the vocabulary makes the engine step raise: every turn in that step gets the error (no hang),
    the session state is dropped, and the next turns are served normally."""
    import asyncio

    engine = create_rollout_engine("native", tiny_model_path, dtype="fp32", seed=0, num_threads=1)
    gen = RolloutEngineGenerator(engine)
    greedy = SamplingParams(greedy=True)

    async def both():
        return await asyncio.gather(gen.generate([5, 6, 7], 4, greedy, session="ok"),
                                    gen.generate([5, 10**6], 4, greedy, session="bad"), return_exceptions=True)

    results = asyncio.run(both())
    assert all(isinstance(r, IndexError) for r in results), results
    assert gen.sessions.idle and gen.sessions.memory()["parked_sessions"] == 0
    again = asyncio.run(gen.generate([5, 6, 7], 4, greedy, session="ok"))
    assert len(again.token_ids) == 4 and again.finish_reason == "length"


@pytest.mark.parametrize("keep_kv", [True, False], ids=["sessions", "re-prefill"])
def test_a_follower_replays_the_first_ranks_engine_ops_to_the_same_state(tiny_lm, tiny_model_path, keep_kv):
    """A tensor-parallel group's other ranks replay the first rank's ops (mirror / follow): their session engine goes
    through the same states (same prefill and reuse counts, every session freed), and the re-prefill path's batches
    are replayed too. The ops pickle (they cross processes in broadcast_object_list)."""
    import pickle

    from hybridflow.agents.engine_generator import STOP

    _, tok = tiny_lm
    sampling = SamplingParams(temperature=0.8, top_k=30, top_p=0.95, seed=7)
    log: list[list[tuple]] = []
    first = create_rollout_engine("native", tiny_model_path, dtype="fp32", seed=0, num_threads=1)
    lead = RolloutEngineGenerator(first, keep_kv=keep_kv,
                                  mirror=lambda ops: log.append(pickle.loads(pickle.dumps(ops))))
    episodes = AgentLoop(lead, tok, CFG, env_factory=Countdown).run_sync(ROWS, sampling)
    assert all(e.trajectory.num_assistant_turns > 1 for e in episodes)
    log.append([(STOP, None)])
    other = create_rollout_engine("native", tiny_model_path, dtype="fp32", seed=0, num_threads=1)
    follower = RolloutEngineGenerator(other, keep_kv=keep_kv)
    replayed = []

    def receive():
        replayed.append(log[len(replayed)])
        return replayed[-1]

    assert follower.follow(receive) is None and len(replayed) == len(log)
    if keep_kv:
        assert follower.stats == lead.stats and lead.stats["prefill_tokens"] > 0
        assert follower.sessions.idle and follower.sessions.memory()["parked_sessions"] == 0
    else:
        assert sum(op[0] == "generate" for ops in log for op in ops) == lead.calls > 1
