"""The native engine's sessions (engines/rollout/sessions.py): K/V kept between a session's turns, only new tokens
prefilled, turns joining and leaving a running decode, the token cap's eviction rule; every output checked against a
re-prefill of the whole context (NativeRollout.generate) or transformers, on real tiny models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_native_archs import write_arch_model
from transformers import AutoModelForCausalLM

from hybridflow.agents.generator import HFGenerator
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.engines.rollout.layout import read_prompts
from hybridflow.engines.rollout.sessions import SessionMemoryError, TurnRequest
from hybridflow.protocol import DataProto

GREEDY = SamplingParams(greedy=True)


def _engine(path):
    return create_rollout_engine("native", path, dtype="fp32", seed=0, num_threads=1, decode="eager")


def _drain(sessions, requests=()) -> list[TurnRequest]:
    for r in requests:
        sessions.submit(r)
    done = []
    while not sessions.idle:
        done += sessions.step()
    return done


def _reprefill_greedy(engine, context: list[int], max_new: int, stop_ids=()) -> list[int]:
    """The same turn by re-prefilling the whole context: NativeRollout.generate on a one-row batch."""
    ids = torch.tensor([context])
    mask = torch.ones_like(ids)
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1})
    read_prompts(batch)
    out = engine.generate(batch, SamplingParams(greedy=True, max_new_tokens=max_new, stop_token_ids=list(stop_ids)))
    n = int(out.batch["response_mask"][0].sum())
    return out.batch["responses"][0, :n].tolist()


def _hf_log_probs(model, context: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([context + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    P = len(context)
    return torch.log_softmax(logits[P - 1 : -1] / temperature, -1).gather(-1, ids[0, P:, None]).squeeze(-1)


def _observation(session: int, turn: int) -> list[int]:
    return [40 + (session * 7 + turn * 3 + k) % 50 for k in range(2 + (session + turn) % 4)]


@pytest.fixture(scope="module", params=["qwen2", "gemma2", "mistral"])
def model_path(request, tmp_path_factory, tiny_model_path):
    """The shared tiny Qwen2 (sliding layers off), Gemma 2 (soft-capping, sliding layers shorter than the
    sessions), Mistral (every layer sliding)."""
    if request.param == "qwen2":
        return tiny_model_path
    return write_arch_model(tmp_path_factory.mktemp(request.param), request.param)


def test_kept_kv_greedy_equals_reprefill_and_log_probs_match_a_forward(model_path):
    """Three sessions x three turns, all in one batch: each turn's greedy tokens are those of a re-prefill of its
    whole context, only the tokens after the kept ones are prefilled, and the log-probs match transformers'
    forward over the context + turn within 1e-5."""
    engine = _engine(model_path)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    sessions = engine.open_sessions(max_batch_size=8, stop_token_ids=[])
    contexts = {i: [5 + i, 17, 30 + i, 9] * (i + 2) for i in range(3)}
    new_tokens = sum(map(len, contexts.values()))
    for turn in range(3):
        done = _drain(sessions, [TurnRequest(i, list(contexts[i]), 6 + 2 * i, GREEDY) for i in range(3)])
        assert sorted(r.session for r in done) == [0, 1, 2]
        for r in done:
            assert r.finish_reason == "length" and len(r.token_ids) == 6 + 2 * r.session
            assert r.token_ids == _reprefill_greedy(engine, r.context, len(r.token_ids)), (turn, r.session)
            err = (torch.tensor(r.log_probs) - _hf_log_probs(hf, r.context, r.token_ids, 1.0)).abs().max()
            assert err <= 1e-5, err
            obs = _observation(r.session, turn)
            contexts[r.session] = r.context + r.token_ids + obs
            if turn < 2:
                new_tokens += 1 + len(obs)  # the last generated token (never fed) and the observation
    assert sessions.stats["prefill_tokens"] == new_tokens  # nothing was prefilled twice
    assert sessions.stats["reused_tokens"] > 2 * sessions.stats["prefill_tokens"]
    assert sessions.stats["turns"] == 9 and sessions.stats["max_running_rows"] == 3
    for i in range(3):
        sessions.end_session(i)
    assert sessions.memory()["parked_tokens"] == 0 and sessions.memory()["parked_sessions"] == 0


def test_turns_join_a_running_decode_and_sample_as_if_alone(tiny_model_path):
    """A long turn keeps decoding while a short session's turns leave the batch and rejoin it; every sampled turn
    draws the tokens it draws when run alone on transformers (per-row random streams), log-probs equal within 1e-5."""
    engine = _engine(tiny_model_path)
    sampling = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)

    def req(session, context, budget, seed):
        return TurnRequest(session, list(context), budget, dataclasses.replace(sampling, seed=seed))

    sessions = engine.open_sessions(max_batch_size=4, stop_token_ids=[])
    long_turn = req("long", [7, 8, 9, 10, 11] * 3, 40, seed=1)
    sessions.submit(long_turn)
    sessions.step()
    short_context = [20, 21, 22]
    shorts = []
    for turn in range(4):
        short = req("short", short_context, 3, seed=10 + turn)
        sessions.submit(short)
        while short.finish_reason is None:
            sessions.step()
        assert long_turn.finish_reason is None  # the long turn was decoding the whole time
        shorts.append(short)
        short_context = short.context + short.token_ids + _observation(1, turn)
    _drain(sessions)
    assert sessions.stats["joined_running"] >= 4 and sessions.stats["reused_tokens"] > 0
    # each turn alone, on transformers, in the stream of its seed (HFGenerator: the agent loop's reference)
    reference = HFGenerator(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), [10**6])
    for r in [long_turn, *shorts]:
        alone = reference._decode(r.context, r.max_new_tokens, r.sampling)
        assert alone.token_ids == r.token_ids
        assert torch.allclose(torch.tensor(alone.log_probs), torch.tensor(r.log_probs), atol=1e-5, rtol=0)


def test_token_cap_evicts_parked_sessions_lru_and_refuses_what_cannot_fit(tiny_model_path):
    engine = _engine(tiny_model_path)
    cap = 90
    sessions = engine.open_sessions(max_batch_size=8, max_cached_tokens=cap, stop_token_ids=[])
    contexts = {i: [5 + i, 17, 30 + i, 9] * 4 for i in range(3)}  # 16 tokens each; a turn reserves 16 + 8
    for turn in range(3):
        for i in range(3):
            sessions.submit(TurnRequest(i, list(contexts[i]), 8, GREEDY))
        done = []
        while not sessions.idle:
            done += sessions.step()
            held = sessions.memory()
            assert held["parked_tokens"] + held["reserved_tokens"] <= cap, held
        for r in done:
            assert r.error is None
            assert r.token_ids == _reprefill_greedy(engine, r.context, 8)  # evicted or kept, the same tokens
            contexts[r.session] = r.context + r.token_ids + _observation(r.session, turn)
    stats = sessions.stats
    assert stats["evictions"] >= 1 and stats["reprefills_after_eviction"] >= 1 and stats["reused_tokens"] > 0
    # a turn that cannot fit even alone fails by itself, with the numbers; the engine goes on serving
    too_long = TurnRequest("big", list(range(4, 4 + cap)), 8, GREEDY)
    ok = TurnRequest(0, list(contexts[0]), 4, GREEDY)
    done = _drain(sessions, [too_long, ok])
    assert isinstance(too_long.error, SessionMemoryError) and "max_cached_tokens=90" in str(too_long.error)
    assert ok.error is None and ok.token_ids == _reprefill_greedy(engine, ok.context, 4)


def test_history_mismatch_end_session_and_new_weights(tiny_model_path):
    engine = _engine(tiny_model_path)
    sessions = engine.open_sessions(stop_token_ids=[])
    (first,) = _drain(sessions, [TurnRequest("a", [5, 6, 7, 8, 9, 10], 5, GREEDY)])
    with pytest.raises(ValueError, match="already has a turn"):
        sessions.submit(TurnRequest("a", [1, 2], 3, GREEDY))
        sessions.submit(TurnRequest("a", [1, 2], 3, GREEDY))
    sessions.waiting.clear()
    # a context that does not extend the kept tokens: counted, and the whole context is prefilled
    changed = [5, 6, 7, 99, *first.token_ids]
    (again,) = _drain(sessions, [TurnRequest("a", changed, 5, GREEDY)])
    assert sessions.stats["mismatches"] == 1 and again.token_ids == _reprefill_greedy(engine, changed, 5)
    # new weights: the kept K/V is stale and is dropped
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    engine.update_weights((n, p.detach() * 1.5) for n, p in hf.named_parameters() if n.endswith("proj.weight"))
    context = again.context + again.token_ids + [40, 41]
    (after,) = _drain(sessions, [TurnRequest("a", context, 5, GREEDY)])
    assert sessions.stats["invalidated"] == 1 and sessions.stats["reprefills_after_eviction"] == 1
    assert after.token_ids == _reprefill_greedy(engine, context, 5)
    sessions.end_session("a")
    assert sessions.memory()["parked_sessions"] == 0
    # a session ended while its turn runs is not kept
    sessions.submit(TurnRequest("b", [5, 6, 7], 4, GREEDY))
    sessions.step()
    sessions.end_session("b")
    _drain(sessions)
    assert sessions.memory()["parked_sessions"] == 0 and not sessions.closing
