"""veRL's fsdp_config.model_dtype / model.torch_dtype: the dtype the training engine loads and keeps its weights in."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_batch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.workers.engine_config import engine_config


def pg_loss(micro, outputs):
    mask = micro.batch["response_mask"].float()
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["global_num_tokens"]
    return loss, {}


def test_bf16_weights_are_kept_and_trained_in_bf16(tiny_model_path):
    fp32 = FSDPEngine(EngineConfig(model_path=tiny_model_path, optim=OptimConfig(lr=1e-2)))
    bf16 = FSDPEngine(EngineConfig(model_path=tiny_model_path, optim=OptimConfig(lr=1e-2), model_dtype="bf16"))
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    bytes_of = lambda e: sum(p.numel() * p.element_size() for p in e.model.parameters())  # noqa: E731
    assert bytes_of(bf16) * 2 == bytes_of(fp32)
    data = make_batch(rows=4, prompt_len=6, response_len=8, seed=1)
    # the same model scored in both: bf16 rounding only
    lp32 = fp32.compute_log_prob(data, temperature=1.0)["log_probs"]
    lp16 = bf16.compute_log_prob(data, temperature=1.0)["log_probs"]
    assert lp16.dtype == torch.float32 and 0 < float((lp32 - lp16).abs().max()) < 0.1
    before = {n: p.detach().clone() for n, p in bf16.model.named_parameters()}
    metrics = bf16.train_step(data, pg_loss)
    assert metrics["skipped_nonfinite"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in bf16.model.named_parameters())
    state = next(iter(bf16.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16  # no fp32 copy anywhere


def test_the_keys_choose_each_engines_dtype(tiny_model_path):
    cfg = load_config(["actor_rollout_ref.model.torch_dtype=bfloat16",
                       "actor_rollout_ref.ref.fsdp_config.model_dtype=float32"])
    arr = cfg.actor_rollout_ref
    common = {"model_path": tiny_model_path, "model": arr.model, "seed": 0, "micro_batch_size": 2,
              "use_dynamic_bsz": False, "max_token_len": 64}
    assert engine_config(role="actor", fsdp=arr.actor.fsdp_config, **common).model_dtype == "bf16"
    assert engine_config(role="ref", fsdp=arr.ref.fsdp_config, **common).model_dtype == "fp32"
    critic = load_config(["critic.fsdp_config.model_dtype=bf16"]).critic
    assert engine_config(role="critic", fsdp=critic.fsdp_config, **{**common, "model": critic.model}
                         ).model_dtype == "bf16"
    assert engine_config(role="actor", fsdp=load_config([]).actor_rollout_ref.actor.fsdp_config,
                         **{**common, "model": load_config([]).actor_rollout_ref.model}).model_dtype == "fp32"


@pytest.mark.parametrize("override, match", [
    ("actor_rollout_ref.actor.fsdp_config.model_dtype=fp16",
     r"actor_rollout_ref\.actor\.fsdp_config\.model_dtype='fp16'.*loss scaling"),
    ("actor_rollout_ref.model.torch_dtype=int8", r"actor_rollout_ref\.model\.torch_dtype='int8': choose fp32"),
])
def test_other_dtypes_are_refused_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config([override])
