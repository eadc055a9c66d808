"""Start-up errors of the tensor-parallel layout: each names the numbers to change (config.py + preflight.py)."""

from __future__ import annotations

import pytest

from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.preflight import preflight_errors

TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"


@pytest.mark.parametrize("overrides, match", [
    ([f"{TP}=2", "trainer.n_gpus_per_node=3"], r"=2 does not divide the 3 rollout ranks \(trainer.nnodes\*trainer"),
    ([f"{TP}=4", "trainer.nnodes=2", "trainer.n_gpus_per_node=2"], r"=4 is larger than the 2 ranks of one node"),
    ([f"{TP}=0"], r"=0 must be >= 1"),
    ([f"{TP}=2", "actor_rollout_ref.hybrid_engine=false", "trainer.backend=ray",
      "actor_rollout_ref.rollout.n_gpus_per_node=3"], r"does not divide the 3 rollout ranks \(actor_rollout_ref.rollout"),
    ([f"{TP}=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=hf"], r"hf does not split the model"),
])
def test_layout_errors_name_the_numbers(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


@pytest.mark.parametrize("overrides, match", [
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.fsdp_size=3"],
     r"actor\.fsdp_config\.fsdp_size=3: the ranks that shard one copy of the model must divide the 2 training ranks"
     r".*choose one of \[1, 2\], or -1"),
    (["trainer.n_gpus_per_node=4", "critic.fsdp_config.fsdp_size=0"], r"critic\.fsdp_config\.fsdp_size=0: .*\[1, 2, 4\]"),
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.fsdp_config.fsdp_size=1",
      "actor_rollout_ref.actor.fsdp_config.tensor_model_parallel_size=2"],
     r"fsdp_size=1 \(hybrid sharding\) cannot be combined with tensor/sequence parallelism"),
])
def test_an_fsdp_size_that_does_not_fit_is_a_config_error_before_any_worker_starts(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)
    ok = load_config(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.fsdp_size=1"])
    assert ok.actor_rollout_ref.actor.fsdp_config.fsdp_size == 1  # 2 replicas of the whole model (HSDP)


def test_a_layout_that_fits_is_taken():
    cfg = load_config([f"{TP}=2", "trainer.n_gpus_per_node=2"])
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2


@pytest.mark.parametrize("tp, match", [
    (3, r"num_attention_heads=4 does not split over 3 tensor-parallel ranks"),
    (4, r"num_key_value_heads=2 does not split over 4 tensor-parallel ranks"),
])
def test_heads_that_do_not_split_are_a_preflight_error(tiny_model_path, tp, match):
    batch = ["data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=12",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]  # splits over 3 and 4 ranks
    cfg = load_config([f"{TP}={tp}", f"trainer.n_gpus_per_node={tp}", f"actor_rollout_ref.model.path={tiny_model_path}",
                       *batch])
    errors = preflight_errors(cfg)
    assert any(__import__("re").search(match, e) for e in errors), errors
    fits = load_config([f"{TP}=2", "trainer.n_gpus_per_node=2", f"actor_rollout_ref.model.path={tiny_model_path}"])
    assert not [e for e in preflight_errors(fits) if "tensor-parallel" in e]


BI = "actor_rollout_ref.model.batch_invariant=true"


@pytest.mark.parametrize("overrides, match", [
    (["actor_rollout_ref.rollout.name=hf"], r"with actor_rollout_ref.rollout.name=hf"),
    (["actor_rollout_ref.model.use_remove_padding=false"], r"model.use_remove_padding=false"),
    (["actor_rollout_ref.rollout.dtype=bf16"], r"rollout.dtype=bf16"),
    (["actor_rollout_ref.actor.fsdp_config.param_dtype=bf16"], r"actor.fsdp_config.param_dtype=bf16"),
    (["actor_rollout_ref.rollout.enforce_eager=false"], r"rollout.enforce_eager=false"),
    (["actor_rollout_ref.model.lora_rank=4"], r"model.lora_rank=4"),
])
def test_batch_invariance_names_the_setting_that_breaks_it(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config([BI, *overrides])


def test_batch_invariance_is_taken_with_the_defaults():
    assert load_config([BI]).actor_rollout_ref.model.batch_invariant is True


def test_vllm_on_cpu_with_a_mixture_of_experts_model_is_refused_at_start_up(tmp_path, tiny_model_path):
    """vLLM's CPU build computes with wrong experts after an in-place weight update (vllm_rollout.py), so the vLLM
    rollout of an MoE policy on CPU is a start-up error naming the native engine; a dense model is not refused."""
    from hybridflow.engines.tiny import write_tiny_model

    moe = write_tiny_model(tmp_path / "moe", "unit", arch="qwen3_moe")
    with pytest.raises(ConfigError, match=r"mixture-of-experts.*wrong experts.*rollout\.name=native"):
        load_config([f"actor_rollout_ref.model.path={moe}", "actor_rollout_ref.rollout.name=vllm",
                     "trainer.device=cpu"])
    for model, name in ((moe, "native"), (tiny_model_path, "vllm")):
        try:
            load_config([f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.name={name}",
                         "trainer.device=cpu"])
        except ConfigError as err:  # the main venv has no vLLM: that error, never the experts one
            assert "wrong experts" not in str(err)
