"""Multi-turn GRPO end to end: veRL's rollout.multi_turn keys -> episodes on the Ray rollout ranks -> rewards with
the episode in extra_info -> an update; samples.jsonl and `hybridflow report` show the conversation turn by turn.
Bad input: a tool config naming a missing class stops at start-up, naming the file and the class."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.data.tasks.agent_tasks import generate_calculator_task, generate_guess_number_task
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main import run_training

SCORER_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the episode's record reaches the user's scorer: a reward that needs it fails loudly without it
    assert extra_info["num_turns"] >= 1 and extra_info["secret"] == int(ground_truth)
    assert extra_info["termination"] and isinstance(extra_info["tool_calls"], list)
    assert extra_info["turns"][0]["role"] == "user" and extra_info["turns"][1]["role"] == "assistant"
    return 0.5 * sum(m["role"] == "assistant" for m in extra_info["turns"])
'''

MULTI_TURN = [
    "data.return_raw_chat=true", "data.max_prompt_length=48", "data.max_response_length=64",
    "actor_rollout_ref.rollout.multi_turn.enable=true",
    "actor_rollout_ref.rollout.multi_turn.environment=guess_number",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=6",
]


@pytest.mark.parametrize("engine,ranks,tp", [("native", 1, 1), ("hf", 2, 1), ("native", 2, 2)])
def test_one_multi_turn_grpo_step_on_ray(engine, ranks, tp, ray_session, tiny_model_path, tmp_path):
    """tp=2: veRL's multi-turn scripts set a tensor-parallel rollout; the group's first rank runs the episodes and the
    other replays its engine ops (agents/engine_generator.py, mirror / follow)."""
    files = generate_guess_number_task(str(tmp_path / "data"), num_train=16, num_val=4, num_sft_games=1)
    # veRL's per-row agent loop (the agent_name column): every other prompt a plain single-turn generation
    table = pq.read_table(files["train"])
    pq.write_table(table.append_column("agent_name", [["tool_agent", "single_turn_agent"] * (table.num_rows // 2)]),
                   files["train"])
    scorer = tmp_path / "turn_scorer.py"
    scorer.write_text(SCORER_FILE)
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(
        (files["train"], files["val"]), tiny_model_path, run_dir, *MULTI_TURN,
        "trainer.backend=ray", f"trainer.n_gpus_per_node={ranks}", f"actor_rollout_ref.rollout.name={engine}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        "trainer.total_training_steps=1", "trainer.log_samples_freq=1",
        f"custom_reward_function.path={scorer}", "custom_reward_function.name=compute_score",
    ))
    result = run_training(cfg, progress=False)
    assert result.global_step == 1
    row = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][-1]
    # the episodes were multi-turn (a random policy rarely finds the number at once) and trained on
    assert row["agent/assistant_turns/mean"] > 1 and 0 < row["agent/observation_token_share/mean"] < 1
    assert sum(v for k, v in row.items() if k.startswith("agent/termination/")) == pytest.approx(1.0)
    assert row["agent/env_time_s/mean"] >= 0 and "actor/pg_loss" in row
    # the user's score (0.5 per assistant turn, from extra_info) plus the environment's reward is the row's score
    assert row["reward/user_score_mean"] == pytest.approx(0.5 * row["agent/assistant_turns/mean"], rel=1e-5)
    assert row["critic/score/mean"] == pytest.approx(row["reward/user_score_mean"] + row["reward/env_reward_mean"],
                                                     rel=1e-5)
    samples = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    by_loop = {name: [s for s in samples if s["agent_name"] == name] for name in ("tool_agent", "single_turn_agent")}
    assert by_loop["tool_agent"] and by_loop["single_turn_agent"]
    assert all(s["num_turns"] == 1 and len(s["conversation"]) == 2 for s in by_loop["single_turn_agent"])
    assert max(s["num_turns"] for s in by_loop["tool_agent"]) > 1
    episode = max(samples, key=lambda s: s["num_turns"])
    roles = [m["role"] for m in episode["conversation"]]
    assert roles[:3] == ["user", "assistant", "user"] and episode["termination"]

    from hybridflow.trainer.report import make_report

    page = open(make_report(run_dir)["html"]).read()
    assert "turns · ended by" in page and "<i>assistant</i>" in page


def test_calculator_tool_through_verl_tool_config_file(ray_session, tiny_model_path, tmp_path):
    """tool_config_path (veRL's file) on Ray: the tool classes load in the workers; keys reach the loop."""
    files = generate_calculator_task(str(tmp_path / "data"), num_train=8, num_val=4, num_sft=1)
    tool_file = tmp_path / "tools.yaml"
    tool_file.write_text(
        "tools:\n"
        "  - class_name: hybridflow.agents.builtin.VerlCalculatorTool\n"
        "    config: {type: native}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: calculator\n"
        "        description: evaluate integer arithmetic\n"
        "        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}\n")
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(
        (files["train"], files["val"]), tiny_model_path, run_dir, "data.return_raw_chat=true",
        "data.max_response_length=32", "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_file}",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=8",
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=right",
        "actor_rollout_ref.rollout.mode=async",  # veRL's multi-turn scripts set it (its default)
        "trainer.backend=ray", "trainer.total_training_steps=1"))
    assert run_training(cfg, progress=False).global_step == 1


def test_multi_turn_keys_are_taken_and_bad_ones_refused(tmp_path):
    from hybridflow.trainer.config import classify_overrides

    keys = ["enable=true", "max_assistant_turns=2", "max_user_turns=2", "tool_config_path=x.yaml", "format=hermes",
            "max_parallel_calls=2", "max_tool_response_length=64", "tool_response_truncate_side=left"]
    classified = classify_overrides([f"actor_rollout_ref.rollout.multi_turn.{k}" for k in keys])
    assert len(classified["taken"]) == len(keys) and not classified.get("refused")
    missing = tmp_path / "tools.yaml"
    missing.write_text("tools:\n  - class_name: hybridflow.agents.builtin.NoSuchTool\n    config: {type: native}\n")
    with pytest.raises(ConfigError) as err:
        load_config(["data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
                     f"actor_rollout_ref.rollout.multi_turn.tool_config_path={missing}"])
    assert str(missing) in str(err.value) and "NoSuchTool" in str(err.value)
    for overrides, needle in [
        (["actor_rollout_ref.rollout.multi_turn.enable=true",
          "actor_rollout_ref.rollout.multi_turn.environment=guess_number"], "data.return_raw_chat=true"),
        (["data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
          "actor_rollout_ref.rollout.multi_turn.environment=no_such_env"], "unknown agent environment 'no_such_env'"),
        (["data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
          "actor_rollout_ref.rollout.multi_turn.environment=guess_number",
          "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top"], "tool_response_truncate_side"),
        (["actor_rollout_ref.rollout.multi_turn.environment=guess_number"], "enable=false"),
        (["actor_rollout_ref.rollout.multi_turn.interaction_config_path=i.yaml"], "Interaction classes"),
    ]:
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
            load_config(overrides)


def test_remax_greedy_baseline_is_an_episode_too(tiny_model_path, tmp_path):
    """ReMax generates a greedy baseline inside the step: it runs as episodes, scored with the environment's reward."""
    files = generate_guess_number_task(str(tmp_path / "data"), num_train=8, num_val=4, num_sft_games=1)
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides((files["train"], files["val"]), tiny_model_path, run_dir, *MULTI_TURN,
                                         "trainer.backend=local", "algorithm.adv_estimator=remax",
                                         "trainer.total_training_steps=1"))
    assert run_training(cfg, progress=False).global_step == 1
    row = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][-1]
    assert row["agent/assistant_turns/mean"] > 1
