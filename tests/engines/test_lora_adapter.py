"""veRL's actor_rollout_ref.model.lora_adapter_path: LoRA training that starts from a saved PEFT adapter folder."""

from __future__ import annotations

import json

import pytest
from test_lora import lora_engine, trained
from test_train_distributed import make_batch, seq_mean_pg_loss

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine
from hybridflow.engines.lora import LoraSettings


@pytest.fixture(scope="module")
def exported(tiny_model_path, tmp_path_factory):
    """A LoRA run's checkpoint exported both ways: (adapter folder, merged model folder)."""
    from hybridflow.cli import main as cli_main

    out = tmp_path_factory.mktemp("lora_export")
    trained(tiny_model_path).save_checkpoint(str(out / "actor"))
    assert cli_main(["export", str(out / "actor"), str(out / "adapter"), "--adapter"]) == 0
    assert cli_main(["export", str(out / "actor"), str(out / "merged")]) == 0
    return str(out / "adapter"), str(out / "merged")


def test_the_adapter_is_the_policy_at_step_zero(tiny_model_path, exported):
    adapter, merged = exported
    start = lora_engine(tiny_model_path, LoraSettings(rank=4, alpha=8, adapter_path=adapter))
    plain = FSDPEngine(EngineConfig(model_path=merged, role="ref", micro_batch_size_per_gpu=4))
    fresh = lora_engine(tiny_model_path)
    probe = make_batch(rows=6, prompt_len=8, response_len=12, seed=50)
    got = start.compute_log_prob(probe, temperature=0.8)["log_probs"]
    want = plain.compute_log_prob(probe, temperature=0.8)["log_probs"]
    assert float((got - want).abs().max()) <= 1e-5  # base + the saved adapter = the merged model
    assert float((fresh.compute_log_prob(probe, temperature=0.8)["log_probs"] - want).abs().max()) > 1e-3
    # the reference stays the base model, and the loaded adapter trains on (only its tensors)
    base = start.compute_log_prob(probe, temperature=0.8, base=True)["log_probs"]
    assert float((base - fresh.compute_log_prob(probe, temperature=0.8)["log_probs"]).abs().max()) <= 1e-6
    start.train_step(make_batch(rows=8, prompt_len=8, response_len=12, seed=3), seq_mean_pg_loss)
    assert all(".lora_" in n for n, p in start.model.named_parameters() if p.requires_grad)


def test_an_adapter_that_does_not_fit_the_keys_is_named(tiny_model_path, exported, tmp_path):
    adapter, _ = exported
    with pytest.raises(ValueError, match=r"the adapter has r=4 but actor_rollout_ref.model.lora_rank=8"):
        lora_engine(tiny_model_path, LoraSettings(rank=8, alpha=8, adapter_path=adapter))
    with pytest.raises(ValueError, match=r"the adapter has lora_alpha=8 but actor_rollout_ref.model.lora_alpha=16"):
        lora_engine(tiny_model_path, LoraSettings(rank=4, alpha=16, adapter_path=adapter))
    with pytest.raises(ValueError, match=r"does not fit the LoRA layers of .*target_modules=\['q_proj'\].*saved tensors"):
        lora_engine(tiny_model_path, LoraSettings(rank=4, alpha=8, target_modules=["q_proj"], adapter_path=adapter))
    with pytest.raises(ValueError, match=r"is not a folder"):
        lora_engine(tiny_model_path, LoraSettings(rank=4, alpha=8, adapter_path=str(tmp_path / "missing")))
    assert json.load(open(f"{adapter}/adapter_config.json"))["r"] == 4


def test_the_config_checks_the_adapter_before_any_worker(exported):
    from hybridflow.trainer.config import ConfigError, load_config

    adapter, _ = exported
    key = f"actor_rollout_ref.model.lora_adapter_path={adapter}"
    with pytest.raises(ConfigError, match=r"lora_adapter_path needs LoRA on: set actor_rollout_ref.model.lora_rank=4"):
        load_config([key])
    with pytest.raises(ConfigError, match=r"r=4 but actor_rollout_ref.model.lora_rank=16"):
        load_config([key, "actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=8"])
    cfg = load_config([key, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"])
    from hybridflow.workers.engine_config import lora_settings

    assert lora_settings(cfg.actor_rollout_ref.model).adapter_path == adapter
