"""veRL's reward-loop keys: reward_model.use_reward_loop picks the engine and where it runs, reward_model.rollout.*
configure it, and a key the chosen engine does not read is refused by name."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from e2e_helpers import make_batch, tiny_run_overrides

from hybridflow.engines.tiny import build_char_tokenizer, write_tiny_reward_model
from hybridflow.rewards import build_reward_manager
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main import reward_spec, run_training

SLOW_REWARD = str(Path(__file__).parent / "slow_reward.py")


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> str:
    return write_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"), seed=7)


@pytest.mark.parametrize("overrides, match", [
    (["reward_model.rollout.gpu_memory_utilization=0.8"], r"gpu_memory_utilization=0.8 is the share of device memory "
     r"vLLM reserves up front; the hf engine"),
    (["reward_model.use_reward_loop=true", "reward_model.rollout.gpu_memory_utilization=0.8"],
     r"gpu_memory_utilization=0.8 .* the hf engine"),
    (["reward_model.rollout.gpu_memory_utilization=1.5"], r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
    (["reward_model.rollout.tensor_model_parallel_size=4"], r"tensor_model_parallel_size=4: the hf engine holds one "
     r"whole copy"),
    (["reward_model.rollout.name=vllm"], r"rollout.name=vllm is read only with reward_model.use_reward_loop=true"),
    (["reward_model.use_reward_loop=true", "reward_model.rollout.name=sglang"], r"SGLang / TensorRT-LLM are not "
     r"supported; choose one of \['hf', 'vllm'\]"),
    (["reward_model.rollout.response_length=0"], r"response_length=0 must be >= 1"),
    (["reward_model.use_reward_loop=true", "reward_model.rollout.name=native"], r"native engine generates text"),
    (["reward_model.enable_resource_pool=true"], r"a reward-model pool sized apart from the trainer's"),
    (["reward_model.rollout.dtype=bfloat16"], r"reward_model.rollout.dtype: not in hybridflow yet: this option of the "
     r"reward model's engine"),
    (["reward_model.model.fsdp_config.wrap_policy.min_num_params=0"], r"this FSDP option for the reward model"),
])
def test_keys_the_chosen_engine_does_not_read_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


def test_vllm_reward_engine_options_are_taken_where_vllm_is(monkeypatch):
    """With vLLM installed the reward loop's vllm options validate; without it (the main venv), the error says how
    to get it. Padding removal off means nothing to vLLM: refused."""
    import hybridflow.engines.reward_model.vllm as rm_vllm

    keys = ["reward_model.enable=true", "reward_model.model.path=x", "reward_model.use_reward_loop=true",
            "reward_model.rollout.name=vllm", "reward_model.rollout.gpu_memory_utilization=0.8",
            "reward_model.rollout.tensor_model_parallel_size=2", "reward_model.rollout.prompt_length=256",
            "reward_model.rollout.response_length=128"]
    monkeypatch.setattr(rm_vllm, "vllm_available", lambda: True)
    cfg = load_config(keys)
    assert cfg.reward_model.rollout.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="vLLM packs the rows and never computes padding"):
        load_config([*keys, "reward_model.model.use_remove_padding=false"])
    monkeypatch.setattr(rm_vllm, "vllm_available", lambda: False)
    with pytest.raises(ConfigError, match=r"rollout.name=vllm needs vLLM.*setup_vllm_env.sh"):
        load_config(keys)


def test_the_manager_fetches_late_model_scores_after_the_rule_scores(tiny_model_path):
    """RewardManager(batch, rm_scores=late): the rule scorers run first, then the late scores are fetched and added
    (weight reward_model.weight), so a reward model scoring elsewhere overlaps the rule scoring."""
    cfg = load_config([f"custom_reward_function.path={SLOW_REWARD}", "custom_reward_function.name=slow_exact",
                       "reward_model.num_workers=1", "reward_model.weight=0.5"])
    from hybridflow.trainer.main import load_reward_function

    manager = build_reward_manager("naive", build_char_tokenizer(), reward_spec(cfg, load_reward_function(cfg)))
    batch = make_batch(6, 4, 5, seed=1)
    batch.non_tensor_batch.update(data_source=np.array(["t"] * 6, dtype=object),
                                  ground_truth=np.array(["never"] * 6, dtype=object))
    fetched: list[float] = []
    rm = torch.arange(6, dtype=torch.float32)

    def late():
        fetched.append(time.monotonic())
        return rm

    try:
        result = manager(batch, rm_scores=late)
    finally:
        manager.close()
    assert len(fetched) == 1 and fetched[0] > max(result.extra["scored_at"])  # after the last rule score
    torch.testing.assert_close(result.scores, 0.5 * rm)  # rule scores are 0 here
    assert torch.equal(batch.batch["rm_scores"], rm) and "reward/rm_wait_s" in result.metrics


def test_the_reward_loop_runs_in_processes_of_its_own(ray_session, tiny_model_path, rm_path):
    """use_reward_loop=true: the reward model's group shares no process with the actor; false: it is colocated."""
    from hybridflow.trainer.placement import build_worker_groups

    base = [f"actor_rollout_ref.model.path={tiny_model_path}", "reward_model.enable=true",
            f"reward_model.model.path={rm_path}", "trainer.backend=ray"]
    pids = {}
    for loop in (True, False):
        groups = build_worker_groups(load_config([*base, f"reward_model.use_reward_loop={str(loop).lower()}"]),
                                     need_ref=False, need_critic=False, need_rm=True)
        try:
            pids[loop] = ({i["pid"] for i in groups.reward_model.worker_info},
                          {i["pid"] for i in groups.actor_rollout.worker_info})
        finally:
            groups.shutdown()
    assert not pids[True][0] & pids[True][1]
    assert pids[False][0] == pids[False][1]


def test_a_ppo_run_with_the_reward_loop_overlaps_model_and_rule_scoring(ray_session, arithmetic_files,
                                                                       tiny_model_path, rm_path, tmp_path):
    """End to end on Ray: veRL's reward-loop keys (hf engine, truncation); the model's scores reach the reward, and
    by the time the slow rule scores are in, the model (in its own process) is already done."""
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(
        arithmetic_files, tiny_model_path, run_dir, "trainer.backend=ray", "reward_model.enable=true",
        f"reward_model.model.path={rm_path}", "reward_model.use_reward_loop=true", "reward_model.rollout.name=hf",
        "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.rollout.prompt_length=16",
        "reward_model.rollout.response_length=4", "reward_model.model.fsdp_config.param_offload=true",
        f"custom_reward_function.path={SLOW_REWARD}", "custom_reward_function.name=slow_exact",
    ))
    result = run_training(cfg, progress=False)
    assert result.global_step == 2
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["reward/rm_score_mean"] != 0.0 and np.isfinite(row["reward/rm_score_mean"])
        # 16 responses x 0.05 s of rule scoring; the tiny model needs a few ms: nothing is left to wait for
        assert row["reward/rm_wait_s"] < 0.2, row["reward/rm_wait_s"]


def test_the_reward_loops_devices_count_against_the_cluster():
    from hybridflow.trainer.config import check_resources

    cfg = load_config(["trainer.device=cuda", "trainer.n_gpus_per_node=4", "reward_model.enable=true",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                       "reward_model.model.path=x", "reward_model.use_reward_loop=true"])
    with pytest.raises(ConfigError, match=r"8 GPU ranks .*plus 4 for the reward loop's engines.*use_reward_loop=false"):
        check_resources(cfg, available_cpus=16, available_gpus=4)
    cfg.reward_model.use_reward_loop = False
    check_resources(cfg, available_cpus=16, available_gpus=4)  # the legacy worker shares the actor's processes


def test_a_reward_model_with_another_tokenizer_needs_a_chat_template(tmp_path, tiny_model_path, rm_path):
    """Another tokenizer: the conversation is re-rendered in the reward model's chat template (and the loader keeps
    raw_prompt for it); without a template that cannot be done, refused before the run."""
    from transformers import AutoTokenizer

    from hybridflow.trainer.preflight import preflight_errors
    from hybridflow.trainer.reward_loop import reward_model_rerenders

    base = ["reward_model.enable=true", f"actor_rollout_ref.model.path={tiny_model_path}"]
    same = load_config([*base, f"reward_model.model.path={rm_path}"])
    assert not reward_model_rerenders(same) and not [e for e in preflight_errors(same) if "tokenizer" in e]
    other = tmp_path / "other_rm"
    write_tiny_reward_model(other, seed=1)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra_token>"])
    tok.save_pretrained(other)
    cfg = load_config([*base, f"reward_model.model.path={other}"])
    assert reward_model_rerenders(cfg) and not [e for e in preflight_errors(cfg) if "tokenizer" in e]
    tok.chat_template = None
    tok.save_pretrained(other)
    (other / "chat_template.jinja").unlink(missing_ok=True)
    errors = preflight_errors(cfg)
    assert any("is not the policy's" in e and "has no chat template" in e for e in errors), errors


def test_two_reward_loop_engines_split_a_batch_and_give_the_one_engine_scores(ray_session, tiny_model_path, rm_path):
    """trainer.n_gpus_per_node=2: two engine processes (veRL's colocate count), each scoring its share of the rows;
    7 rows (padded to 8 for the split) come back as the 7 scores one engine gives."""
    from hybridflow.single_controller.future import DataProtoFuture
    from hybridflow.trainer.placement import build_reward_loop_group
    from hybridflow.workers.reward_model import RewardModelWorker

    keys = [f"actor_rollout_ref.model.path={tiny_model_path}", "reward_model.enable=true",
            f"reward_model.model.path={rm_path}", "reward_model.use_reward_loop=true", "trainer.backend=ray",
            "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    batch = make_batch(7, 8, 6, seed=9)
    one = RewardModelWorker(load_config(keys))
    one.init_model()
    group, pool = build_reward_loop_group(load_config(keys))
    try:
        assert group.world_size == 2
        group.init_model()
        out = group.compute_rm_score(batch)
        assert isinstance(out, DataProtoFuture)
        torch.testing.assert_close(out.get().batch["rm_scores"], one.compute_rm_score(batch).batch["rm_scores"])
    finally:
        group.shutdown()
        pool.shutdown()
