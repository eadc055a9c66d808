"""LoRA in the training engine (PEFT): adapter-only training, the adapter-disabled reference, merged weight sync,
adapter checkpoints, bad input. Real transformers + peft models built from a tiny config, fp32 on CPU."""

from __future__ import annotations

import pytest
import torch
from test_rollout_engines import make_prompts
from test_train_distributed import make_batch, seq_mean_pg_loss

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.lora import LoraSettings
from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.0)
LORA = LoraSettings(rank=4, alpha=8)


def lora_engine(path: str, lora: LoraSettings = LORA, **kw) -> FSDPEngine:
    return FSDPEngine(EngineConfig(model_path=path, optim=OPTIM, lora=lora, micro_batch_size_per_gpu=4, **kw))


def trained(path: str, steps: int = 2) -> FSDPEngine:
    engine = lora_engine(path)
    for i in range(steps):
        engine.train_step(make_batch(rows=8, prompt_len=8, response_len=12, seed=i), seq_mean_pg_loss)
    return engine


def test_only_adapter_parameters_train_and_hold_optimizer_state(tiny_model_path):
    engine = trained(tiny_model_path)
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: every projection of every layer has an adapter, the LM head none
    assert any("q_proj.lora_A" in n for n in trainable) and any("down_proj.lora_B" in n for n in trainable)
    assert not any("lm_head" in n or "embed" in n for n in trainable)
    in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    by_id = {id(p): n for n, p in engine.model.named_parameters()}
    assert {by_id[i] for i in in_optimizer} == trainable
    assert {by_id[id(p)] for p in engine.optimizer.state} == trainable
    # the updates moved B off its zero init
    assert any(float(p.detach().abs().max()) > 0 for n, p in engine.model.named_parameters() if ".lora_B." in n)


def test_reference_is_the_base_model_with_the_adapter_disabled(tiny_model_path):
    engine = trained(tiny_model_path)
    base = FSDPEngine(EngineConfig(model_path=tiny_model_path, role="ref", micro_batch_size_per_gpu=4))
    probe = make_batch(rows=6, prompt_len=8, response_len=12, seed=50)
    ref = engine.compute_log_prob(probe, temperature=0.8, base=True)["log_probs"]
    want = base.compute_log_prob(probe, temperature=0.8)["log_probs"]
    assert float((ref - want).abs().max()) <= 1e-6
    adapted = engine.compute_log_prob(probe, temperature=0.8)["log_probs"]
    assert float((adapted - want).abs().max()) > 1e-3  # the adapter is back on after the block


def test_merged_weights_carry_base_names_and_sync_the_native_rollout(tiny_model_path):
    engine = trained(tiny_model_path)
    plain = FSDPEngine(EngineConfig(model_path=tiny_model_path, role="ref"))
    names = [n for n, _ in engine.named_full_parameters()]
    assert names == [n for n, _ in plain.named_full_parameters()]
    assert [n for n, _ in engine.named_parameter_shapes()] == names
    rollout = create_rollout_engine("native", tiny_model_path, num_threads=1)
    prompts = make_prompts(rollout.tokenizer)
    params = SamplingParams(temperature=0.8, n=2, max_new_tokens=12, seed=3)
    before = rollout.generate(prompts, params)
    rollout.update_weights(engine.named_full_parameters())
    after = rollout.generate(prompts, params)
    assert not torch.equal(after.batch["rollout_log_probs"], before.batch["rollout_log_probs"])
    train = engine.compute_log_prob(after, temperature=0.8)["log_probs"]
    stats = logprob_mismatch(after.batch["rollout_log_probs"], train, after.batch["response_mask"])
    assert stats["mismatch/max_abs"] <= 1e-5, stats
    # the hf rollout engine takes the same merged stream
    hf = create_rollout_engine("hf", tiny_model_path, num_threads=1)
    hf.update_weights(engine.named_full_parameters())
    out = hf.generate(prompts, params)
    train = engine.compute_log_prob(out, temperature=0.8)["log_probs"]
    assert logprob_mismatch(out.batch["rollout_log_probs"], train, out.batch["response_mask"])["mismatch/max_abs"] <= 1e-5


def test_checkpoint_holds_the_adapter_and_resumes_bitwise(tiny_model_path, tmp_path):
    engine = trained(tiny_model_path)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "ckpt" / "model_rank0.safetensors"))
    assert saved and all(".lora_" in n for n in saved)
    extra = make_batch(rows=8, prompt_len=8, response_len=12, seed=9)
    first = engine.train_step(extra, seq_mean_pg_loss)
    after = engine.full_state_dict()
    again = lora_engine(tiny_model_path)
    again.load_checkpoint(str(tmp_path / "ckpt"))
    second = again.train_step(extra, seq_mean_pg_loss)
    assert first["grad_norm"] == second["grad_norm"]
    resumed = again.full_state_dict()
    assert all(torch.equal(after[k], resumed[k]) for k in after)
    with pytest.raises(ValueError, match="LoRA"):
        FSDPEngine(EngineConfig(model_path=tiny_model_path, optim=OPTIM)).load_checkpoint(str(tmp_path / "ckpt"))


def test_bad_lora_settings_are_named(tiny_model_path):
    with pytest.raises(ValueError, match="lora_rank is -1"):
        lora_engine(tiny_model_path, LoraSettings(rank=-1))
    with pytest.raises(ValueError, match=r"matches no module.*q_proj"):
        lora_engine(tiny_model_path, LoraSettings(rank=4, target_modules=["query_key_value"]))
    with pytest.raises(ValueError, match="all-linear"):
        lora_engine(tiny_model_path, LoraSettings(rank=4, target_modules="everything"))


def test_export_writes_a_merged_model_or_a_peft_adapter_both_loadable(tiny_model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridflow.cli import main as cli_main

    engine = trained(tiny_model_path)
    engine.save_checkpoint(str(tmp_path / "actor"))
    expected = engine.full_state_dict()
    assert cli_main(["export", str(tmp_path / "actor"), str(tmp_path / "merged")]) == 0
    assert cli_main(["export", str(tmp_path / "actor"), str(tmp_path / "adapter"), "--adapter"]) == 0

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    state = merged.state_dict()
    assert max(float((state[k] - v).abs().max()) for k, v in expected.items()) <= 1e-6
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size < 0.5 * sum(
        p.stat().st_size for p in (tmp_path / "merged").glob("*.safetensors"))
    ids = torch.randint(4, 250, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = merged(input_ids=ids).logits
        got = peft(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-5
    with torch.no_grad(), peft.disable_adapter():
        assert float((peft(input_ids=ids).logits - want).abs().max()) > 1e-4  # the adapter is what changed it


def test_export_adapter_of_a_full_checkpoint_is_refused(tiny_model_path, tmp_path):
    from hybridflow.trainer.checkpoint import CheckpointError
    from hybridflow.trainer.export import export_checkpoint

    FSDPEngine(EngineConfig(model_path=tiny_model_path, optim=OPTIM)).save_checkpoint(str(tmp_path / "actor"))
    with pytest.raises(CheckpointError, match="not a LoRA checkpoint"):
        export_checkpoint(str(tmp_path / "actor"), str(tmp_path / "out"), adapter=True)


def test_config_refuses_a_negative_rank_and_a_bad_target_string():
    from hybridflow.trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="lora_rank=-2"):
        load_config(["actor_rollout_ref.model.lora_rank=-2"])
    with pytest.raises(ConfigError, match="target_modules"):
        load_config(["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=attention"])
    cfg = load_config(["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"])
    assert cfg.actor_rollout_ref.model.lora_rank == 8


def test_lora_composes_with_gradient_checkpointing(tiny_model_path):
    batch = make_batch(rows=8, prompt_len=8, response_len=12, seed=5)
    plain, recomputed = lora_engine(tiny_model_path), lora_engine(tiny_model_path, gradient_checkpointing=True)
    a, b = plain.train_step(batch, seq_mean_pg_loss), recomputed.train_step(batch, seq_mean_pg_loss)
    assert a["grad_norm"] > 0 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"]
    x, y = plain.full_state_dict(), recomputed.full_state_dict()
    assert max(float((x[k] - y[k]).abs().max()) for k in x) <= 1e-6


def test_mixture_of_experts_adapts_experts_and_router_and_merges_them(tmp_path):
    """PEFT's all-linear on Qwen3-MoE (transformers 5) adapts the attention Linears and, through ParamWrappers, the 3-D
    expert parameters and the router weight. The merged weights carry the plain names, give the adapted model's
    logits, sync the native rollout (mismatch within fp32 rounding) and export as a merged model and as a PEFT adapter
    that loads back."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridflow.cli import main as cli_main
    from hybridflow.engines.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "moe", "unit", arch="qwen3_moe", seed=0)
    engine = lora_engine(path, LoraSettings(rank=4, alpha=8))
    adapted = {n for n, _ in engine.model.named_parameters() if ".lora_A." in n}
    assert any(".experts." in n for n in adapted) and any(".mlp.gate." in n for n in adapted)
    for i in range(2):
        engine.train_step(make_batch(rows=8, prompt_len=8, response_len=12, seed=i), seq_mean_pg_loss)
    merged = dict(engine.named_full_parameters())
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base = plain.state_dict()
    assert set(merged) <= set(base) and set(base) - set(merged) <= {"lm_head.weight"}  # a tied head once
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    assert not torch.equal(merged[experts], base[experts])
    plain.load_state_dict(merged, strict=False)
    ids = torch.randint(4, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = engine.model.hf(input_ids=ids).logits
        assert float((plain(input_ids=ids).logits - want).abs().max()) <= 1e-5

    rollout = create_rollout_engine("native", path, num_threads=1)
    rollout.update_weights(engine.named_full_parameters())
    params = SamplingParams(temperature=0.8, n=2, max_new_tokens=10, seed=1)
    out = rollout.generate(make_prompts(rollout.tokenizer), params)
    train = engine.compute_log_prob(out, temperature=0.8)["log_probs"]
    stats = logprob_mismatch(out.batch["rollout_log_probs"], train, out.batch["response_mask"])
    assert stats["mismatch/max_abs"] <= 1e-5, stats

    engine.save_checkpoint(str(tmp_path / "actor"))
    assert cli_main(["export", str(tmp_path / "actor"), str(tmp_path / "merged")]) == 0
    assert cli_main(["export", str(tmp_path / "actor"), str(tmp_path / "adapter"), "--adapter"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                     str(tmp_path / "adapter"))
    with torch.no_grad():
        assert float((exported(input_ids=ids).logits - want).abs().max()) <= 1e-5
        assert float((peft(input_ids=ids).logits - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # tied head; an untied head (frozen, not adapted)
def test_bf16_compute_keeps_the_frozen_base_in_bf16_with_the_same_bits(arch, tmp_path, monkeypatch):
    """With bf16 compute on one rank the frozen base projections are stored in bf16 once (autocast would cast them in
    every forward): log-probs, gradient norms and adapters after updates are those of the base kept in fp32, bit for
    bit; the adapters stay fp32; the merged weights synced out are fp32, W rounded to bf16 plus the adapter's delta."""
    from test_native_archs import write_arch_model

    from hybridflow.engines import fsdp_engine
    from hybridflow.engines.hf_model import hf_name
    from hybridflow.engines.lora import base_name

    path = write_arch_model(tmp_path / arch, arch)
    lora = LoraSettings(rank=4, alpha=8, exclude_modules=["o_proj"])  # frozen and not adapted: stored in bf16 too
    kept = lora_engine(path, lora, param_dtype="bf16")
    with monkeypatch.context() as m:
        m.setattr(fsdp_engine, "store_frozen_projections_in", lambda model, dtype: None)
        master = lora_engine(path, lora, param_dtype="bf16")
    dtypes = {n: p.dtype for n, p in kept.model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if ".lora_" in n or "norm" in n or "embed" in n)
    assert {d for n, d in dtypes.items() if "base_layer" in n or ".o_proj." in n} == {torch.bfloat16}
    assert (arch == "llama") == (dtypes["hf.lm_head.weight"] == torch.bfloat16 if "hf.lm_head.weight" in dtypes
                                 else False)
    assert sum(p.numel() * p.element_size() for p in kept.model.parameters()) < sum(
        p.numel() * p.element_size() for p in master.model.parameters())
    probe = make_batch(rows=4, prompt_len=6, response_len=8, seed=60)
    for step in range(2):
        batch = make_batch(rows=8, prompt_len=8, response_len=12, seed=step)
        got, want = kept.train_step(batch, seq_mean_pg_loss), master.train_step(batch, seq_mean_pg_loss)
        assert got["grad_norm"] == want["grad_norm"] > 0
        for base in (False, True):
            assert torch.equal(kept.compute_log_prob(probe, temperature=0.8, base=base)["log_probs"],
                               master.compute_log_prob(probe, temperature=0.8, base=base)["log_probs"])
    synced, exact = dict(kept.named_full_parameters()), dict(master.named_full_parameters())
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in kept.named_parameter_shapes()}
    assert shapes == {n: (tuple(t.shape), t.dtype) for n, t in synced.items()} and synced.keys() == exact.keys()
    bases = {base_name(hf_name(n)): p.detach() for n, p in master.model.named_parameters()
             if base_name(hf_name(n)) is not None}
    stored = {base_name(hf_name(n)): p.dtype for n, p in kept.model.named_parameters()
              if base_name(hf_name(n)) is not None}
    for name, tensor in synced.items():  # differing by W's bf16 rounding where W is kept in bf16, no more
        rounding = bases[name].to(stored[name]).float() - bases[name]
        assert tensor.dtype == torch.float32 and torch.allclose(tensor - exact[name], rounding, atol=1e-6), name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(synced[q], exact[q])  # the merged q_proj does carry the rounded base
