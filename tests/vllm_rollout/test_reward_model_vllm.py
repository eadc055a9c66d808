"""reward_model.rollout.name=vllm: vLLM's pooling runner scores the reward model (veRL's reward loop), the same
scores as the transformers engine, on the same truncated rows; the engine keys reach vLLM."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_batch
from vllm_test_utils import MODEL_SIZE

from hybridflow.engines.tiny import write_tiny_reward_model
from hybridflow.trainer.config import load_config
from hybridflow.workers.reward_model import RewardLoopWorker, RewardModelWorker


@pytest.fixture(scope="session")
def rm_path(tmp_path_factory) -> str:
    return write_tiny_reward_model(tmp_path_factory.mktemp("vllm_tiny_rm"), spec=MODEL_SIZE, seed=3)


def keys(rm_path: str, *extra: str) -> list[str]:
    return [f"reward_model.model.path={rm_path}", "reward_model.enable=true", "data.max_prompt_length=12",
            "data.max_response_length=10", "reward_model.rollout.prompt_length=6",
            "reward_model.rollout.response_length=5", *extra]


@pytest.fixture(scope="session")
def vllm_worker(rm_path):
    """One pooling engine for the session: dropping a vLLM engine mid-session tears down process-wide state that
    the other tests' engines still use."""
    cfg = load_config(keys(rm_path, "reward_model.use_reward_loop=true", "reward_model.rollout.name=vllm",
                           "reward_model.rollout.gpu_memory_utilization=0.8",
                           "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.micro_batch_size_per_gpu=4"))
    worker = RewardLoopWorker(cfg)
    worker.init_model()
    yield worker


def test_vllm_pooling_scores_match_the_transformers_engine_on_truncated_rows(rm_path, vllm_worker):
    batch = make_batch(7, 12, 10, seed=5)
    hf = RewardModelWorker(load_config(keys(rm_path)))
    hf.init_model()
    expected = hf.compute_rm_score(batch).batch["rm_scores"]
    got = vllm_worker.compute_rm_score(batch).batch["rm_scores"]
    # vLLM's CPU kernels sum in another order than transformers': agreement to ~1e-3 of scores spread over ~0.1
    untruncated = RewardModelWorker(load_config([f"reward_model.model.path={rm_path}", "reward_model.enable=true"]))
    untruncated.init_model()
    full = untruncated.compute_rm_score(batch).batch["rm_scores"]
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    assert (full - got).abs().max() > 1e-2  # the truncation changed what was scored, far beyond that tolerance


def test_the_engine_keys_reach_vllm(vllm_worker):
    config = vllm_worker.scorer.llm.llm_engine.vllm_config
    assert config.model_config.runner_type == "pooling"
    assert config.cache_config.gpu_memory_utilization == 0.8
    assert config.parallel_config.tensor_parallel_size == 1
    assert config.scheduler_config.max_num_seqs == 4  # reward_model.micro_batch_size_per_gpu
    assert config.model_config.max_model_len == 6 + 5  # the longest row the truncation lets through


def test_a_run_with_the_vllm_reward_loop_on_ray(ray_session, arithmetic_files, model_path, rm_path, tmp_path):
    """veRL's reward-loop keys as its RM scripts set them (sizes shrunk): vLLM's pooling runner in a Ray process of
    its own scores every step, next to the rule scores."""
    import json
    import math

    from e2e_helpers import tiny_run_overrides

    from hybridflow.trainer.main import run_training

    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(
        arithmetic_files, model_path, run_dir, "trainer.backend=ray", "reward_model.enable=true",
        f"reward_model.model.path={rm_path}", "reward_model.use_reward_loop=true", "reward_model.rollout.name=vllm",
        "reward_model.rollout.gpu_memory_utilization=0.8", "reward_model.rollout.tensor_model_parallel_size=1",
        "reward_model.rollout.prompt_length=32", "reward_model.rollout.response_length=8",
    ))
    result = run_training(cfg, progress=False)
    assert result.global_step == 2
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    for row in rows:
        assert math.isfinite(row["reward/rm_score_mean"]) and row["reward/rm_score_mean"] != 0.0
        assert "reward/rm_wait_s" in row  # scored by the reward loop, fetched after the rule scores
