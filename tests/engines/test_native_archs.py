"""Every architecture of the native rollout (arch_specs.py) end to end, against transformers and the training engine.

Per architecture, on a unit-size random model whose config turns on that architecture's features (sliding windows
shorter than the sequences, Llama-3 rope scaling, q/k norms, Gemma's soft-capping and (1 + w) norms, Phi-3's fused
weights, partial rotary and longrope, SmolLM3's layers without rotary embedding): greedy native == HF ``generate``
token for token in every decode mode; native log-probs == the FSDP engine's within 1e-5 (fp32), also after a weight
update; the exported folder loads with AutoModelForCausalLM and gives the same logits.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from e2e_helpers import tiny_run_overrides
from test_rollout_engines import make_prompts
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from hybridflow.cli import main as cli_main
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.onednn_train import OneDNNLinear, use_onednn_linears
from hybridflow.engines.rollout import SamplingParams, cpu_linear, create_rollout_engine
from hybridflow.engines.rollout.arch_specs import resolve, supported_architectures
from hybridflow.engines.rollout.native_model import NativeDecoder
from hybridflow.engines.tiny import SIZES, TINY_ARCHITECTURES, build_char_tokenizer, make_config
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main import run_training

ARCHS = ["qwen2", "qwen3", "qwen3_moe", "llama", "mistral", "gemma2", "gemma3_text", "phi3", "smollm3"]
WINDOW = 8  # shorter than prompt + response: the sliding layers really drop keys
# decode mode -> engine kwargs. "panel" and "onednn": eager steps with packed weights (on by default only from hidden
# size 256 up; forced here on the unit model), multiplied by the panel kernel (cpu_linear.py; oneDNN where it cannot
# be built) or by oneDNN
DECODES = {"eager": {"decode": "eager"}, "static": {"decode": "static"},
           "panel": {"decode": "eager", "prepack": True},
           "onednn": {"decode": "eager", "prepack": True, "linear_kernel": False}}
PACKED = {"panel": "panel" if cpu_linear.kernel_for(None) is not None else "onednn", "onednn": "onednn"}


def arch_config(arch: str, init: float = 0.3):
    """The unit-size config of `arch` with its distinctive features switched on; a wide weight init (`init` std) so
    that greedy outputs vary instead of repeating one token."""
    tokenizer = build_char_tokenizer()
    window = WINDOW if arch != "llama" else None  # Llama has no sliding window
    config = make_config(dataclasses.replace(SIZES["unit"], arch=arch, sliding_window=window,
                                             tie_word_embeddings=arch not in ("llama", "phi3")), tokenizer)
    config.initializer_range = init
    if arch == "qwen3":  # long-context Qwen3 checkpoints ship YaRN scaling
        config.attention_bias = True
        config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 32}
    if arch == "qwen3_moe":
        config.mlp_only_layers = [0]  # a dense layer, then a routed one
    if arch == "llama":
        config.attention_bias = config.mlp_bias = True
        config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16}
    if arch == "smollm3":  # its last layer has no rotary embedding and slides (the config's own rule)
        config.attention_bias = config.mlp_bias = True
    if arch == "gemma2":  # small caps, so that the wide-init scores and logits really get capped
        config.attn_logit_softcapping, config.final_logit_softcapping = 2.0, 3.0
    if arch == "gemma3_text":
        config.final_logit_softcapping = 3.0
        config.query_pre_attn_scalar = 24
        config.rope_parameters["full_attention"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}
    if arch == "phi3":
        rotary_half = int(config.hidden_size // config.num_attention_heads * 0.5) // 2
        config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "short_factor": [1.0 + 0.5 * i for i in range(rotary_half)],
                                  "long_factor": [4.0 + i for i in range(rotary_half)],
                                  "original_max_position_embeddings": 64, "factor": 4.0}
        config.max_position_embeddings = 256
        config.original_max_position_embeddings = 64
    return config, tokenizer


def write_arch_model(path, arch: str, seed: int = 0, init: float = 0.3) -> str:
    config, tokenizer = arch_config(arch, init)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases and norm weights random too: a decoder that dropped one would decode differently
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(-0.5, 0.5) if arch.startswith("gemma") else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=ARCHS)
def arch_path(request, tmp_path_factory):
    return request.param, write_arch_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def hf_outputs(arch_path):
    """HF generate's greedy outputs for n=1 (one cache segment per row) and n=2 (shared prompt K/V)."""
    _, path = arch_path
    hf = create_rollout_engine("hf", path, num_threads=1)
    prompts = make_prompts(hf.tokenizer)
    return {n: hf.generate(prompts, SamplingParams(greedy=True, n=n, max_new_tokens=18)) for n in (1, 2)}


def ref_engine(path: str, role: str = "ref") -> FSDPEngine:
    return FSDPEngine(EngineConfig(model_path=path, role=role, optim=OptimConfig(lr=1e-3, weight_decay=0.0),
                                   micro_batch_size_per_gpu=4))


def fp64_log_probs(engine: FSDPEngine, out, temperature: float) -> torch.Tensor:
    """The rollout's tokens scored by the engine's current weights in float64: [B, R], the values both fp32 engines
    approximate."""
    hf = engine.model.hf
    exact = AutoModelForCausalLM.from_config(hf.config, experts_implementation="eager").double().eval()  # MoE: no fp64 grouped_mm
    exact.load_state_dict({name: t.detach().double() for name, t in hf.state_dict().items()})
    b = out.batch
    R = b["responses"].shape[1]
    with torch.no_grad():
        logits = exact(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, -R - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None]).squeeze(-1)


def assert_log_probs_match(out, engine: FSDPEngine, temperature: float, tol: float = 1e-5) -> dict:
    """max |native - training engine| <= tol, or, where the training engine's own fp32 error (max |train - fp64|)
    is larger than tol, no larger than that: on these wide-init models it reaches 2e-5, and a bound below it
    measures which rounding noise a run happens to draw, not the decoder."""
    train = engine.compute_log_prob(out, temperature=temperature)["log_probs"]
    mask = out.batch["response_mask"]
    stats = logprob_mismatch(out.batch["rollout_log_probs"], train, mask)
    own = logprob_mismatch(train, fp64_log_probs(engine, out, temperature), mask)["mismatch/max_abs"]
    stats["train_vs_fp64/max_abs"] = own
    # Gemma 2's fp64 eager forward gives NaN at some of these positions: there the plain tol
    assert stats["mismatch/max_abs"] <= (max(tol, own) if math.isfinite(own) else tol), stats
    return stats


def test_arch_features_are_really_on():
    """The test configs exercise what the specs claim: sliding layers, per-type rope, soft-capping, fused names."""
    shapes = {arch: resolve(arch_config(arch)[0]) for arch in ARCHS}
    assert {layer.window for layer in shapes["qwen2"].layers} == {None, WINDOW}
    assert {layer.window for layer in shapes["mistral"].layers} == {WINDOW}
    gemma = shapes["gemma3_text"]
    assert [(layer.rope, layer.window) for layer in gemma.layers] == [("sliding_attention", WINDOW),
                                                                      ("full_attention", None)]
    assert gemma.final_softcap == 3.0 and gemma.embed_scale == 64**0.5 and gemma.attention_scale == 24**-0.5
    assert gemma.attn_softcap is None and shapes["gemma2"].attn_softcap == 2.0
    assert "self_attn.qkv_proj" in shapes["phi3"].spec.projections
    assert [layer.moe for layer in shapes["qwen3_moe"].layers] == [False, True]
    assert [(layer.rope, layer.window) for layer in shapes["smollm3"].layers] == [("default", None), ("none", WINDOW)]
    assert set(supported_architectures()) == set(ARCHS) == set(TINY_ARCHITECTURES)


@pytest.mark.parametrize("decode", list(DECODES))
def test_greedy_native_equals_hf_generate(arch_path, hf_outputs, decode):
    arch, path = arch_path
    engine = create_rollout_engine("native", path, num_threads=1, **DECODES[decode])
    assert engine.model.matmul == PACKED.get(decode, "dense")
    for n, want in hf_outputs.items():
        got = engine.generate(make_prompts(engine.tokenizer), SamplingParams(greedy=True, n=n, max_new_tokens=18))
        assert torch.equal(got.batch["responses"], want.batch["responses"]), (arch, decode, n)
        assert torch.equal(got.batch["response_mask"], want.batch["response_mask"]), (arch, decode, n)
        torch.testing.assert_close(got.batch["rollout_log_probs"], want.batch["rollout_log_probs"],
                                   atol=1e-5, rtol=1e-5)


def test_native_log_probs_match_the_training_engine_before_and_after_an_update(arch_path):
    arch, path = arch_path
    rollout = create_rollout_engine("native", path, num_threads=1, decode="eager")
    actor = ref_engine(path, role="actor")
    prompts = make_prompts(rollout.tokenizer)
    # vowels stop rows at different steps: the eager cache compacts, the fixed-shape buffers shrink
    stop = [int(t) for t in rollout.tokenizer.convert_tokens_to_ids(list("aeiou"))]
    params = SamplingParams(temperature=0.8, n=3, max_new_tokens=16, seed=4, stop_token_ids=stop)
    before = rollout.generate(prompts, params)
    lengths = before.batch["response_mask"].sum(-1)
    assert int(lengths.min()) < int(lengths.max()) and int(lengths.max()) > WINDOW, lengths
    print(arch, "before update", assert_log_probs_match(before, actor, 0.8))

    # a weight update: perturb every parameter of the actor, sync by HF name as the hybrid worker does
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in actor.model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    rollout.update_weights(actor.named_full_parameters())
    after = rollout.generate(prompts, params)
    assert not torch.equal(after.batch["rollout_log_probs"], before.batch["rollout_log_probs"])
    print(arch, "after update", assert_log_probs_match(after, actor, 0.8))
    static = create_rollout_engine("native", path, num_threads=1, decode="static")
    static.update_weights(actor.named_full_parameters())
    assert torch.equal(static.generate(prompts, params).batch["responses"], after.batch["responses"])


@pytest.fixture(scope="module")
def mild_models(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Per architecture, a model at a milder init and a different model of the same config."""
    root = tmp_path_factory.mktemp("mild")
    return {arch: (write_arch_model(root / arch, arch, seed=0, init=0.1),
                   write_arch_model(root / f"{arch}-other", arch, seed=5, init=0.1)) for arch in ARCHS}


@pytest.mark.parametrize("dtype", ["int8", "bf16"])
def test_low_precision_rollout_drifts_little(mild_models, dtype):
    """int8 (per-channel int8 weights, 7-bit dynamic activations) and bf16 are not exact, and on the wide-init test
    models their error is of order 1; at a milder init they drift by a few 1e-2. A weight in the wrong place, or a
    low-precision branch of the arithmetic gone wrong, would drift like a different model, which here is off by ~1."""
    for arch, (path, other) in mild_models.items():
        engine = create_rollout_engine("native", path, num_threads=1, dtype=dtype)
        out = engine.generate(make_prompts(engine.tokenizer), SamplingParams(n=2, max_new_tokens=12, seed=2))
        drift = {name: logprob_mismatch(out.batch["rollout_log_probs"],
                                        ref_engine(p).compute_log_prob(out, temperature=1.0)["log_probs"],
                                        out.batch["response_mask"])["mismatch/mean_abs"]
                 for name, p in ((dtype, path), ("other model", other))}
        print(arch, drift)
        assert 0 < drift[dtype] < 0.15 and drift[dtype] < 0.2 * drift["other model"], (arch, drift)


def test_exported_model_loads_and_gives_the_same_logits(arch_path, tmp_path):
    arch, path = arch_path
    actor = ref_engine(path, role="actor")
    with torch.no_grad():
        for _, p in actor.model.named_parameters():
            p.mul_(1.01)
    actor.save_hf_model(str(tmp_path / "export"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert loaded.config.model_type == arch
    ids = make_prompts(actor.tokenizer).batch
    with torch.no_grad():
        want = actor.model.hf(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                              position_ids=ids["position_ids"]).logits
        plain = loaded(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                       position_ids=ids["position_ids"]).logits
        # the same weights give the same bits with the engine's projection kernels (onednn_train.py, on CPU)
        if any(isinstance(m, OneDNNLinear) for m in actor.model.modules()):
            use_onednn_linears(loaded)
        got = loaded(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                     position_ids=ids["position_ids"]).logits
    assert torch.equal(got, want)
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-5)  # transformers' own matmuls: rounding only
    # and the native engine reads the export like any checkpoint
    native = create_rollout_engine("native", str(tmp_path / "export"), num_threads=1)
    out = native.generate(make_prompts(native.tokenizer), SamplingParams(greedy=True, max_new_tokens=8))
    assert_log_probs_match(out, ref_engine(str(tmp_path / "export")), 1.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_make_tiny_model_cli_writes_each_architecture(tmp_path, arch, capsys):
    assert cli_main(["make-tiny-model", str(tmp_path / arch), "--arch", arch, "--size", "unit"]) == 0
    assert arch in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / arch)
    assert model.config.model_type == arch
    engine = create_rollout_engine("native", str(tmp_path / arch), num_threads=1)
    prompts = make_prompts(engine.tokenizer)
    want = create_rollout_engine("hf", str(tmp_path / arch)).generate(prompts, SamplingParams(greedy=True,
                                                                                              max_new_tokens=6))
    got = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=6))
    assert torch.equal(got.batch["responses"], want.batch["responses"])


def test_make_tiny_model_rejects_an_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="qwen3"):
        cli_main(["make-tiny-model", str(tmp_path / "x"), "--arch", "gpt2"])


def test_unknown_architecture_names_the_supported_ones_and_the_hf_fallback(tmp_path):
    tokenizer = build_char_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        create_rollout_engine("native", str(tmp_path))
    message = str(err.value)
    assert "'gpt2'" in message and "actor_rollout_ref.rollout.name=hf" in message
    assert all(arch in message for arch in ARCHS)
    # the hf engine runs it
    out = create_rollout_engine("hf", str(tmp_path)).generate(make_prompts(tokenizer),
                                                              SamplingParams(greedy=True, max_new_tokens=3))
    assert out.batch["responses"].shape[0] == 6


def test_dynamic_rope_is_refused_with_the_fallback_named():
    config, _ = arch_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match=r"dynamic.*rollout\.name=hf"):
        NativeDecoder(config, torch.float32, torch.device("cpu"), 64)


def test_moe_refuses_cuda_graphs_and_longrope_stays_in_its_short_range(tmp_path):
    moe = write_arch_model(tmp_path / "moe", "qwen3_moe")
    with pytest.raises(ValueError, match=r"cuda_graph.*expert dispatch.*enforce_eager"):
        create_rollout_engine("native", moe, decode="cuda_graph")
    # Phi-3's longrope switches to its long factors past original_max_position_embeddings (64 in the test config),
    # decided by the longest sequence in a forward pass: the native engine generates within the short range
    phi3 = create_rollout_engine("native", write_arch_model(tmp_path / "phi3", "phi3"), num_threads=1)
    assert phi3.max_model_len == 64
    prompts = make_prompts(phi3.tokenizer)
    out = phi3.generate(prompts, SamplingParams(greedy=True, max_new_tokens=200))
    assert out.batch["input_ids"].shape[1] <= 64


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma2", "gemma3_text", "phi3", "smollm3"])
def test_grpo_trains_each_architecture_with_the_native_rollout(arithmetic_files, tmp_path, arch):
    """Two GRPO steps through the trainer (local backend): rollout, log-prob passes, update, weight sync. The
    second step's rollout runs on the synced weights, so its log-probs must equal the actor's old log-probs."""
    model = str(tmp_path / "model")
    assert cli_main(["make-tiny-model", model, "--arch", arch, "--size", "unit"]) == 0
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(arithmetic_files, model, run_dir, "trainer.backend=local",
                                         "actor_rollout_ref.rollout.name=native", "trainer.save_freq=2"))
    assert run_training(cfg, progress=False).global_step == 2
    with open(f"{run_dir}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]), row
        assert row["rollout/mismatch_max_abs"] <= 1e-5, (arch, row["rollout/mismatch_max_abs"])
    # `hybridflow export` of the run: a transformers folder of the trained weights, which both engines read alike
    assert cli_main(["export", run_dir, str(tmp_path / "export")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    initial = AutoModelForCausalLM.from_pretrained(model)
    assert exported.config.model_type == arch
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), initial.parameters()))
    prompts = make_prompts(build_char_tokenizer())
    params = SamplingParams(greedy=True, max_new_tokens=8)
    native = create_rollout_engine("native", str(tmp_path / "export"), num_threads=1).generate(prompts, params)
    hf = create_rollout_engine("hf", str(tmp_path / "export"), num_threads=1).generate(prompts, params)
    assert torch.equal(native.batch["responses"], hf.batch["responses"])


def test_an_architecture_the_native_engine_does_not_know_trains_with_the_hf_rollout(arithmetic_files, tmp_path):
    tokenizer = build_char_tokenizer()
    config = GPT2Config(vocab_size=288, n_embd=32, n_layer=1, n_head=2, n_positions=128,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    overrides = tiny_run_overrides(arithmetic_files, str(tmp_path / "gpt2"), str(tmp_path / "run"),
                                   "trainer.backend=local")
    # refused before any process starts (the run folder is not touched), with the supported list and the fallback
    with pytest.raises(ConfigError, match=r"(?s)cannot start the run.*model_type='gpt2'.*actor_rollout_ref\.rollout\.name=hf"):
        run_training(load_config([*overrides, "actor_rollout_ref.rollout.name=native"]), progress=False)
    assert not (tmp_path / "run").exists()
    cfg = load_config([*overrides, "actor_rollout_ref.rollout.name=hf"])
    assert run_training(cfg, progress=False).global_step == 2
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert len(f.readlines()) == 2
