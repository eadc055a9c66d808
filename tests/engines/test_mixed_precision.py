"""veRL's fsdp_config.mixed_precision: param_dtype is fsdp_config.param_dtype, reduce_dtype the gradients'
reduce-scatter dtype across ranks (2 Ray actors, gloo, FSDP2), buffer_dtype the model buffers' dtype."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from e2e_helpers import make_batch as engine_batch
from rank_pool import on_all
from test_train_distributed import OPTIM, WORLD, make_batch, seq_mean_pg_loss

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.workers.engine_config import engine_config

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ReduceRank:
    def run(self, model_path: str, reduce_dtype: str, shards: list) -> dict:
        engine = FSDPEngine(EngineConfig(model_path=model_path, optim=OPTIM, reduce_dtype=reduce_dtype))
        policy = engine.model.hf.model.layers[0]._get_fsdp_state()._mp_policy
        norms = [engine.train_step(shard, seq_mean_pg_loss)["grad_norm"] for shard in shards]
        return {"reduce_dtype": policy.reduce_dtype, "norms": norms}


def test_gradients_are_reduced_in_bf16_when_asked(rank_pool, tiny_model_path):
    batch = make_batch(rows=8, prompt_len=8, response_len=12, seed=50)
    shards = [[batch[r * 4 : (r + 1) * 4]] for r in range(WORLD)]
    with rank_pool.spmd(WORLD, ReduceRank) as actors:
        fp32 = on_all(actors, "run", [tiny_model_path] * WORLD, ["fp32"] * WORLD, shards)
        bf16 = on_all(actors, "run", [tiny_model_path] * WORLD, ["bf16"] * WORLD, shards)
    assert {r["reduce_dtype"] for r in fp32} <= {None, torch.float32} and {r["reduce_dtype"] for r in bf16} == {torch.bfloat16}
    a, b = fp32[0]["norms"][0], bf16[0]["norms"][0]
    assert a != b and b == pytest.approx(a, rel=2e-2)  # bf16 rounding of the summed gradients, nothing more


def test_buffers_are_cast_to_buffer_dtype(tiny_model_path):
    plain = FSDPEngine(EngineConfig(model_path=tiny_model_path))
    cast = FSDPEngine(EngineConfig(model_path=tiny_model_path, buffer_dtype="bf16"))
    buffers = [b for b in cast.model.buffers() if b.is_floating_point()]
    assert buffers and all(b.dtype == torch.bfloat16 for b in buffers)
    assert all(b.dtype == torch.float32 for b in plain.model.buffers() if b.is_floating_point())
    data = engine_batch(rows=4, prompt_len=6, response_len=8, seed=2)
    diff = (plain.compute_log_prob(data, temperature=1.0)["log_probs"]
            - cast.compute_log_prob(data, temperature=1.0)["log_probs"]).abs().max()
    assert 0 < float(diff) < 0.05  # RoPE's frequencies rounded to bf16


def test_the_keys(tiny_model_path):
    p = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
    arr = load_config([f"{p}.param_dtype=bf16", f"{p}.reduce_dtype=bf16", f"{p}.buffer_dtype=bfloat16"]
                      ).actor_rollout_ref
    assert arr.actor.fsdp_config.param_dtype == "bf16"
    made = engine_config(model_path=tiny_model_path, role="actor", model=arr.model, fsdp=arr.actor.fsdp_config, seed=0,
                         micro_batch_size=2, use_dynamic_bsz=False, max_token_len=64)
    assert (made.param_dtype, made.reduce_dtype, made.buffer_dtype) == ("bf16", "bf16", "bf16")
    with pytest.raises(ConfigError, match=r"mixed_precision\.reduce_dtype='fp16': choose fp32"):
        load_config([f"{p}.reduce_dtype=fp16"])


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3_moe"])  # tied head + biases; untied head; experts
def test_a_bf16_reference_stores_its_projections_in_bf16_and_scores_as_the_actor(arch, tmp_path):
    """The reference (no optimizer) keeps its linear weights in bf16 instead of autocast casting them in every forward:
    its log-probs are the bf16 actor's (fp32 master weights under autocast) bit for bit, so the KL before the first
    update is exactly 0; embeddings, norms and expert tensors stay fp32."""
    from test_native_archs import write_arch_model

    path = write_arch_model(tmp_path / arch, arch)
    actor = FSDPEngine(EngineConfig(model_path=path, role="actor", param_dtype="bf16", optim=OPTIM))
    ref = FSDPEngine(EngineConfig(model_path=path, role="ref", param_dtype="bf16"))
    kept = {n: p.dtype for n, p in ref.model.named_parameters()}
    linear = {n for n, m in ref.model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linear and all(kept[f"{n}.weight"] == torch.bfloat16 for n in linear if f"{n}.weight" in kept)
    assert {d for n, d in kept.items() if n.rsplit(".", 1)[0] not in linear} == {torch.float32}
    assert (arch == "llama") == (ref.model.hf.get_output_embeddings().weight.dtype == torch.bfloat16)  # untied only
    assert all(p.dtype == torch.float32 for p in actor.model.parameters())
    data = engine_batch(rows=5, prompt_len=7, response_len=9, seed=3)
    for temperature in (1.0, 0.7):
        expect = actor.compute_log_prob(data, temperature=temperature, calculate_entropy=True)
        got = ref.compute_log_prob(data, temperature=temperature, calculate_entropy=True)
        assert torch.equal(got["log_probs"], expect["log_probs"]) and torch.equal(got["entropy"], expect["entropy"])
    fp32 = FSDPEngine(EngineConfig(model_path=path, role="ref"))  # an fp32 reference keeps fp32 weights
    assert all(p.dtype == torch.float32 for p in fp32.model.parameters())
