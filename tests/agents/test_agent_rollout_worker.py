"""The rollout worker's multi-turn path (workers/agent_rollout.py) over real rollout engines, without Ray: the batch
layout, the masks, the row order, the episode records; the loss ignoring observation tokens; the built-in tools."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.agents.builtin import GuessNumberEnv, calculator
from hybridflow.data.tasks.agent_tasks import generate_guess_number_task
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.protocol import DataProto
from hybridflow.trainer.config import load_config
from hybridflow.workers.agent_rollout import AgentRollout


def _prompts(files, tokenizer, rows: int) -> DataProto:
    from hybridflow.data import RLDataLoader, RLDataset

    ds = RLDataset(files["val"], tokenizer, max_prompt_length=48, name="val").head(rows)
    return next(iter(RLDataLoader(ds, rows, shuffle=False, drop_last=False)))


@pytest.mark.parametrize("engine_name", ["native", "hf"])
def test_episodes_come_back_in_the_rollout_layout(engine_name, tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    files = generate_guess_number_task(str(tmp_path), num_train=8, num_val=4, num_sft_games=1)
    cfg = load_config(["data.return_raw_chat=true", "data.max_prompt_length=48", "data.max_response_length=64",
                       "actor_rollout_ref.rollout.multi_turn.enable=true",
                       "actor_rollout_ref.rollout.multi_turn.environment=guess_number",
                       "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
                       "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=6"], validate=True)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    engine = create_rollout_engine(engine_name, tiny_model_path, dtype="fp32", seed=0)
    agent = AgentRollout(cfg, engine, tok)
    prompts = _prompts(files, tok, 4)
    out = agent.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=3))
    b, nt = out.batch, out.non_tensor_batch
    assert b["prompts"].shape == (8, 48) and b["responses"].shape == (8, 64)
    assert b["input_ids"].shape == (8, 112) and torch.equal(b["input_ids"][:, 48:], b["responses"])
    # the prompt part is what the dataset gave (same chat template), left-padded to the same width
    real = prompts.batch["attention_mask"].bool()
    for i in range(8):
        expect = prompts.batch["input_ids"][i // 2][real[i // 2]]
        assert torch.equal(b["prompts"][i][b["attention_mask"][i, :48].bool()], expect)
    # a random policy rarely guesses right: most episodes take several turns with observations between them
    assert max(nt["num_turns"]) > 1
    rm, attn = b["response_mask"], b["attention_mask"][:, 48:]
    assert ((rm == 1) <= (attn == 1)).all()
    for i in range(8):
        spans = nt["turn_spans"][i]
        for s in spans:
            value = 1 if s["kind"] == "assistant" else 0
            assert (rm[i, s["start"]:s["end"]] == value).all()
            assert (attn[i, s["start"]:s["end"]] == 1).all()
        end = spans[-1]["end"] if spans else 0
        assert (attn[i, end:] == 0).all() and (b["rollout_log_probs"][i][rm[i] == 0] == 0).all()
        observations = [s for s in spans if s["kind"] == "observation"]
        if observations:  # what the model saw between its turns: the environment's answer, as tokens
            text = tok.decode(b["responses"][i, observations[0]["start"]:observations[0]["end"]])
            assert any(w in text for w in ("higher", "lower", "Say a number"))
        assert nt["conversation"][i][0]["role"] == "user" and nt["termination"][i] in (
            "env_done", "max_assistant_turns", "response_budget")
    # the two samples of one prompt are the same game (same secret), played with different draws
    assert [c[0]["content"] for c in nt["conversation"]][::2] == [c[0]["content"] for c in nt["conversation"]][1::2]
    assert np.all(np.asarray(nt["agent_reward"], dtype=float) >= 0)
    pos = b["position_ids"]
    for i in range(8):  # positions run 0.. over real tokens, through the response
        m = b["attention_mask"][i].bool()
        assert torch.equal(pos[i][m], torch.arange(int(m.sum())))


def test_the_actor_objective_ignores_observation_tokens():
    from hybridflow.algorithms.objective import LossContext
    from hybridflow.workers.actor_rollout_ref import actor_loss_config

    cfg = load_config(["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01"])
    from hybridflow.algorithms.objective import build_actor_objective

    objective = build_actor_objective(actor_loss_config(cfg.actor_rollout_ref.actor))
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1, 1]], dtype=torch.float32)  # holes: observations
    batch = {"response_mask": mask, "advantages": torch.randn(2, 7, generator=g),
             "old_log_probs": -torch.rand(2, 7, generator=g), "ref_log_probs": -torch.rand(2, 7, generator=g)}
    log_prob, entropy = -torch.rand(2, 7, generator=g), torch.rand(2, 7, generator=g)
    ctx = LossContext(loss_agg_mode="token-mean", global_num_tokens=float(mask.sum()), global_num_seqs=2.0)
    loss, _ = objective(batch, log_prob, entropy, ctx)
    changed = {k: v.clone() for k, v in batch.items()}
    hole = mask == 0
    for k in ("advantages", "old_log_probs", "ref_log_probs"):
        changed[k][hole] = changed[k][hole] * 7 - 3
    loss2, _ = objective(changed, torch.where(hole, log_prob * 5, log_prob), torch.where(hole, entropy * 9, entropy),
                         ctx)
    assert torch.allclose(loss, loss2)
    changed["advantages"][0, 0] += 1.0  # a generated token does count
    assert not torch.allclose(loss, objective(changed, log_prob, entropy, ctx)[0])


def test_builtin_calculator_and_guess_number():
    assert calculator("123*456") == "56088" and calculator("(2+3)*-4") == "-20" and calculator("7//2") == "3"
    for bad in ("__import__('os')", "2**8", "1/0", "9" * 40 + "*" + "9" * 40):
        with pytest.raises(ValueError):
            calculator(bad)
    env = GuessNumberEnv(turn_penalty=0.1, min_reward=0.5)
    env.reset(extra_info={"secret": 7, "low": 1, "high": 20})
    assert env.step("I say 10") == ("lower", None, False, {"guesses": 1})
    assert env.step("no idea")[0].startswith("Say a number")
    assert env.step("5")[0] == "higher"
    obs, reward, done, _ = env.step("7")
    assert obs is None and done and reward == pytest.approx(0.8)  # third guess: 1 - 0.1 * 2
    with pytest.raises(ValueError, match=r"extra_info\.secret"):
        GuessNumberEnv().reset(extra_info={})


def test_observation_truncation_keeps_the_side_veRL_names(tiny_model_path):
    from transformers import AutoTokenizer

    from hybridflow.agents.trajectory import truncate_text

    tok = AutoTokenizer.from_pretrained(tiny_model_path)  # one token per character
    text = "abcdefghij" * 3
    assert truncate_text(tok, text, 40, side="middle") == (text, False)
    assert truncate_text(tok, text, 6, marker="~", side="left") == ("abcdef~", True)
    assert truncate_text(tok, text, 6, marker="~", side="right") == ("~efghij", True)
    assert truncate_text(tok, text, 6, marker="~", side="middle") == ("abc~hij", True)
    big = "x" * 2_000_000 + "END"  # megabytes: cut before tokenizing, the end still reachable
    assert truncate_text(tok, big, 3, marker="~", side="right") == ("~END", True)
    with pytest.raises(ValueError, match="truncate side"):
        truncate_text(tok, text, 6, side="top")
