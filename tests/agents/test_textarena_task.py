"""The textarena_guess_number task against the real textarena game: its SFT demonstrations are what the agent loop
sees when it plays the same moves on TextArenaEnvironment (the same text, the same truncation, the same tokens), and
one multi-turn GRPO step runs on Ray with the `textarena` environment and the task's rows."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
from agent_helpers import ScriptedGenerator
from e2e_helpers import tiny_run_overrides

from hybridflow.agents import AgentLoop, AgentLoopConfig
from hybridflow.agents.adapters import TextArenaEnvironment
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training
from hybridflow.trainer.textarena_task import ENV_ID, PROMPT, generate_textarena_guess_number_task, hidden_number

PRESET = os.path.join(os.path.dirname(__file__), "..", "..", "hybridflow", "config",
                      "agent_textarena_guess_number_grpo.yaml")


def _preset_limits() -> tuple[int, str, int, dict]:
    cfg = load_config([], preset=PRESET, validate=False)
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    return (mt.max_tool_response_length, mt.tool_response_truncate_side, mt.max_assistant_turns,
            dict(mt.environment_kwargs["make_kwargs"]))


def test_demonstrations_are_what_the_loop_sees_on_the_real_game(tiny_lm, tmp_path):
    model, tok = tiny_lm
    max_obs, side, assistant_turns, make_kwargs = _preset_limits()
    # every episode ends by the game's own rules: textarena stops after max_turns + 1 guesses, and one invalid move
    # (a warning, no turn taken) fits in the loop's limit too
    max_turns = make_kwargs["max_turns"] + 1
    assert assistant_turns == max_turns + 1
    num_train = 6
    files = generate_textarena_guess_number_task(str(tmp_path), num_train=num_train, num_val=4, num_sft_games=5,
                                                 max_observation_tokens=max_obs, truncate_side=side,
                                                 max_turns=max_turns, make_kwargs=make_kwargs)
    train, val = pq.read_table(files["train"]).to_pylist(), pq.read_table(files["val"]).to_pylist()
    seeds = {r["extra_info"]["seed"] for r in train}
    assert len(seeds) == num_train and not seeds & {r["extra_info"]["seed"] for r in val}  # held-out games differ
    assert all(r["reward_model"]["ground_truth"] == str(hidden_number(r["extra_info"]["seed"])) for r in val)
    demos = [r["messages"] for r in pq.read_table(files["sft"]).to_pylist()]
    assert any(len(d) > 3 for d in demos)
    # the loop plays each demonstration's moves on the real game (SFT game g used seed num_train + g)
    for g, demo in enumerate(demos):
        moves = iter([m["content"] for m in demo if m["role"] == "assistant"])
        gen = ScriptedGenerator(model, tok, lambda context, moves=moves: next(moves))
        cfg = AgentLoopConfig(max_assistant_turns=assistant_turns, max_response_tokens=1024, max_observation_tokens=max_obs,
                              observation_truncate_side=side)
        loop = AgentLoop(gen, tok, cfg, env_factory=lambda: TextArenaEnvironment(ENV_ID, make_kwargs=make_kwargs))
        (ep,) = loop.run_sync([{"prompt": [{"role": "user", "content": PROMPT}], "seed": num_train + g}])
        assert ep.conversation == demo, g
        # the game's own text, its first prompt cut to its last characters
        assert demo[0]["content"] == PROMPT + "...(truncated)f guesses.\nEnter your guess."  # its last 28
        assert all(m["content"] in ("The target number is higher.", "The target number is lower.")
                   for m in demo[2::2])
        # token level: the SFT row's rendering is the episode's tokens (the template's "\n" after the last turn aside)
        rendered = tok(tok.apply_chat_template(demo, tokenize=False), add_special_tokens=False)["input_ids"]
        assert ep.trajectory.prompt_ids + ep.trajectory.response_ids == rendered[:-1]
        assert ep.termination == "env_done" and ep.reward is not None and 0 < ep.reward <= 1  # the game's reward


def test_one_grpo_step_with_the_textarena_environment(ray_session, tiny_model_path, tmp_path):
    files = generate_textarena_guess_number_task(str(tmp_path / "data"), num_train=8, num_val=4, num_sft_games=1)
    run_dir = str(tmp_path / "run")
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config(tiny_run_overrides(
        (files["train"], files["val"]), tiny_model_path, run_dir,
        "data.return_raw_chat=true", "data.max_prompt_length=96", "data.max_response_length=224",
        f"{mt}.enable=true", f"{mt}.environment=textarena",
        f"{mt}.environment_kwargs={{env_id: {ENV_ID}, make_kwargs: {{max_turns: 2}}}}",  # 3 guesses + 1 invalid
        f"{mt}.max_assistant_turns=4", f"{mt}.max_tokens_per_turn=6", f"{mt}.max_tool_response_length=28",
        f"{mt}.tool_response_truncate_side=right", "actor_rollout_ref.rollout.name=native",
        "trainer.backend=ray", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=1",
        "trainer.log_samples_freq=1",
    ))
    result = run_training(cfg, progress=False)
    assert result.global_step == 1
    row = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][-1]
    assert row["agent/assistant_turns/mean"] >= 1 and 0 < row["agent/observation_token_share/mean"] < 1
    assert row["agent/termination/env_done"] == 1.0  # every game ended by its own rules, with its reward
    assert 0 <= row["agent/env_reward_full_fraction"] <= 1 and "actor/pg_loss" in row
    samples = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    assert samples and all(s["conversation"][0]["content"].startswith(PROMPT + "...(truncated)") for s in samples)
    # an episode that ran on past its first guess got the game's own answer (or its invalid-move text, cut)
    later = [s["conversation"][2]["content"] for s in samples if len(s["conversation"]) > 2]
    assert all(t.startswith("...(truncated)") or t.startswith("The target number is") for t in later)
