"""The training engine's fused CPU ops (engines/cpu_train_ops.py, cpu_train_ops.c): on every architecture the fused
model's logits are transformers' bits and its gradients transformers' to rounding (the rotary path against
transformers' own function), in fp32 and under bf16 autocast (gradients as close to fp32's as transformers'; the bf16
SwiGLU kernel against fp64); partial rotary (Phi-3), per-row position tables, gradient checkpointing; the engine's
choice and its error; the layers of one forward share its rotary tables; other models in the process and other
dtypes keep transformers' ops; an engine with them computes the same log-probs (bitwise) and the same update (to
rounding) as one without, in fp32 and bf16."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from e2e_helpers import make_batch
from test_train_engine import engine, max_diff, params, pg_loss
from transformers import AutoConfig, AutoModelForCausalLM

from hybridflow.engines import cpu_train_ops
from hybridflow.engines.cpu_train_ops import fused_ops_here, use_fused_ops
from hybridflow.engines.tiny import TINY_ARCHITECTURES, TinyModelSpec, write_tiny_model


@pytest.fixture(autouse=True, scope="module")
def kernels():
    # no skip: where the kernels do not build the engine falls back silently, so a failed build must fail here
    assert cpu_train_ops.load() is not None, "the fused training kernels did not build (see the log warning)"

ARCHS = list(TINY_ARCHITECTURES)


def _transformers_module(model):
    attn = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    return sys.modules[type(attn).__mro__[-3].__module__ if type(attn).__name__.startswith("Fused")
                       else type(attn).__module__]


@pytest.fixture
def rotary_calls(monkeypatch):
    calls = []
    real = cpu_train_ops._RotaryFn.apply

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(cpu_train_ops._RotaryFn, "apply", counted)
    return calls


def _forward_backward(model, ids, position_ids=None, original_rotary=None):
    """logits and parameter gradients of a squared-logit loss; `original_rotary` runs transformers' own function."""
    space = _transformers_module(model)
    fused = space.apply_rotary_pos_emb
    if original_rotary:
        space.apply_rotary_pos_emb = fused.__wrapped__ if hasattr(fused, "__wrapped__") else fused
    try:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=position_ids).logits
        logits.pow(2).mean().backward()
    finally:
        space.apply_rotary_pos_emb = fused
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rotating_layers(config) -> int:
    """The layers that apply the rotary embedding: all but SmolLM3's NoPE layers (no_rope_layers 0)."""
    flags = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
    assert len(flags) == config.num_hidden_layers and sum(flags) > 0
    return sum(flags)


def _pair(tmp_path, arch, spec="unit"):
    path = write_tiny_model(tmp_path / arch, spec, arch=arch, seed=0)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    fused = copy.deepcopy(plain)
    return plain, fused, use_fused_ops(fused)


def _assert_same_model_math(plain, fused, ids, position_ids=None):
    a, ga = _forward_backward(plain, ids, position_ids, original_rotary=True)
    b, gb = _forward_backward(fused, ids, position_ids)
    assert torch.equal(a, b), "the fused forward is not transformers' bits"
    assert ga.keys() == gb.keys()
    for name in ga:
        scale = float(ga[name].abs().max()) + 1e-12
        assert float((ga[name] - gb[name]).abs().max()) <= 1e-5 * scale, name


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_same_logits_bitwise_and_gradients(tmp_path, arch, rotary_calls):
    plain, fused, counts = _pair(tmp_path, arch)
    layers = plain.config.num_hidden_layers
    assert counts["rms_norm"] >= 2 * layers + 1 and counts["rotary"] == layers
    dense_silu = arch in ("qwen2", "qwen3", "llama", "mistral", "phi3", "smollm3")
    assert counts["swiglu"] == (layers if dense_silu else 0)  # Gemma: gelu; Qwen3-MoE: routed experts
    _assert_same_model_math(plain, fused, torch.randint(4, 200, (2, 21)))
    assert len(rotary_calls) == 2 * _rotating_layers(plain.config)  # q and k of each layer took the fused path


def test_partial_rotary_and_per_row_position_tables(tmp_path, rotary_calls):
    """Phi-3 with half of each head rotated (the rest passes through), position ids per row (a table per row)."""
    spec = TinyModelSpec(arch="phi3")
    path = write_tiny_model(tmp_path / "phi3", spec, seed=0)
    config = AutoConfig.from_pretrained(path)
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    plain = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    fused = copy.deepcopy(plain)
    use_fused_ops(fused)
    ids = torch.randint(4, 200, (3, 17))
    positions = torch.stack([torch.arange(17), torch.arange(17) + 5, torch.arange(17).flip(0)])
    _assert_same_model_math(plain, fused, ids, positions)
    head_dim = plain.config.hidden_size // plain.config.num_attention_heads
    assert plain.model.rotary_emb(ids.float(), positions)[0].shape[-1] == head_dim // 2
    assert rotary_calls and all(shape[-1] == head_dim for shape in rotary_calls)


def test_gradient_checkpointing_recomputes_through_the_fused_ops(tmp_path, rotary_calls):
    plain, fused, _ = _pair(tmp_path, "qwen3")
    ids = torch.randint(4, 200, (2, 19))
    _, reference = _forward_backward(fused, ids)
    fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fused.train()
    calls_before = len(rotary_calls)
    _, checkpointed = _forward_backward(fused, ids)
    assert len(rotary_calls) - calls_before == 4 * plain.config.num_hidden_layers  # forward + recompute
    assert max_diff(checkpointed, reference) == 0.0


def test_other_models_and_dtypes_keep_transformers_ops(tmp_path, rotary_calls):
    plain, fused, _ = _pair(tmp_path, "llama")
    ids = torch.randint(4, 200, (2, 9))
    # the same transformers module's function, called by a model without the fused ops: transformers' path
    plain(input_ids=ids)
    assert rotary_calls == []
    fused_bf16 = copy.deepcopy(fused).to(torch.bfloat16)
    plain_bf16 = copy.deepcopy(plain).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fused_bf16(input_ids=ids).logits, plain_bf16(input_ids=ids).logits)
    assert rotary_calls == []
    # fp16 autocast: the SwiGLU stays torch's (fp16 is not a fused dtype); the rotation of fp16 q/k against fp32
    # tables is fused (transformers' products promote to fp32 as for bf16): transformers' bits either way
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(fused(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_another_model_of_the_architecture_still_compiles(tmp_path):
    """The wrapped rotary function is the transformers module's, so a model that torch.compile traces in the same
    process (vLLM's Transformers backend compiles transformers' own model code) meets it too: it must trace, whole
    graph, to transformers' function."""
    plain, fused, _ = _pair(tmp_path, "smollm3")
    ids = torch.randint(4, 200, (2, 9))
    torch._dynamo.reset()
    compiled = torch.compile(plain, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=ids).logits, plain(input_ids=ids).logits)
        assert torch.equal(fused(input_ids=ids).logits, plain(input_ids=ids).logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_autocast_same_logits_bitwise_and_gradients_as_close(tmp_path, arch, rotary_calls):
    """The engine's bf16 mode: fp32 parameters under bf16 autocast. The norms see the fp32 residual stream, the
    rotation bf16 q/k against fp32 tables (promoted to fp32), the SwiGLU bf16 gate/up: logits are transformers' bits,
    and the gradients (bf16 rounding once per fused op instead of once per torch op) are as close to the fp32 ones
    as transformers' own."""
    plain, fused, _ = _pair(tmp_path, arch)
    ids = torch.randint(4, 200, (2, 21), generator=torch.Generator().manual_seed(1))
    _, exact = _forward_backward(plain, ids, original_rotary=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, ga = _forward_backward(plain, ids, original_rotary=True)
        b, gb = _forward_backward(fused, ids)
    assert torch.equal(a, b), "the fused forward under bf16 autocast is not transformers' bits"
    assert len(rotary_calls) == 2 * _rotating_layers(plain.config)  # the rotation took the fused path

    def error(grads):
        return sum(float((grads[n] - exact[n]).pow(2).sum()) for n in exact) ** 0.5

    assert ga.keys() == gb.keys() == exact.keys()
    assert error(gb) <= 1.1 * error(ga), (error(gb), error(ga))
    for name in exact:  # and no parameter's gradient is off by more than bf16 rounding
        scale = float(exact[name].abs().max()) + 1e-12
        assert float((ga[name] - gb[name]).abs().max()) <= 0.03 * scale, name


def test_bf16_swiglu_backward_against_fp64():
    """The bf16 SwiGLU backward kernel: both gradients within one bf16 rounding of the exact ones (computed in fp64
    from the same bf16 inputs), on rows that are halves of one buffer (a fused gate/up projection)."""
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(37, 2 * 300, generator=g) * 3).bfloat16()
    grad = torch.randn(37, 300, generator=g).bfloat16()
    a, b = gu[:, :300], gu[:, 300:]
    d = torch.empty_like(gu)
    cpu_train_ops.load().silu_mul_backward(a, b, grad, d[:, :300], d[:, 300:])
    a64, b64, g64 = a.double(), b.double(), grad.double()
    s = torch.sigmoid(a64)
    want_da, want_db = g64 * b64 * s * (1 + a64 * (1 - s)), g64 * a64 * s
    for got, want in ((d[:, :300], want_da), (d[:, 300:], want_db)):
        assert (got.double() - want).abs().le(want.abs() * 2.0**-8 + 1e-30).all()


def test_the_engines_choice_and_its_error():
    cpu = torch.device("cpu")
    assert fused_ops_here(cpu, torch.float32) is True
    assert fused_ops_here(cpu, torch.bfloat16) is True
    assert fused_ops_here(cpu, torch.float16) is False
    assert fused_ops_here(cpu, torch.float32, False) is False
    with pytest.raises(ValueError, match="fused_cpu_ops=True needs fp32 or bf16 on a CPU"):
        fused_ops_here(cpu, torch.float16, True)
    with pytest.raises(ValueError, match="fused_cpu_ops=True needs fp32 or bf16 on a CPU"):
        fused_ops_here(torch.device("meta"), torch.float32, True)


def test_the_layers_of_one_forward_share_its_rotary_tables():
    """transformers passes one (cos, sin) pair to every layer of a forward: the tables derived from it are made
    once, made again for another pair, for a pair written in place since, and for another batch size."""
    cos, sin = torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    first = cpu_train_ops._rotary_tables(cos, sin, 2)
    assert cpu_train_ops._rotary_tables(cos, sin, 2) is first
    assert cpu_train_ops._rotary_tables(cos.clone(), sin, 2) is not first
    assert cpu_train_ops._rotary_tables(cos, sin, 3) is not first
    again = cpu_train_ops._rotary_tables(cos, sin, 2)
    sin.mul_(-1)
    changed = cpu_train_ops._rotary_tables(cos, sin, 2)
    assert changed is not again and torch.equal(changed[1][:, 4:], sin[0, :, 4:])
    assert torch.equal(changed[3], torch.arange(6).repeat(2))
    with torch.inference_mode():  # no version counters there
        cos, sin = torch.randn(1, 6, 8), torch.randn(1, 6, 8)
        assert cpu_train_ops._rotary_tables(cos, sin, 1) is cpu_train_ops._rotary_tables(cos, sin, 1)


def _fused_modules(eng) -> int:
    return sum(type(m).__name__.startswith("Fused") for m in eng.model.modules())


@pytest.mark.parametrize("overrides", [{"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 64},
                                       {"use_remove_padding": False, "micro_batch_size_per_gpu": 4},
                                       {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 64,
                                        "param_dtype": "bf16"}],
                         ids=["packed", "padded", "packed-bf16"])
def test_the_engine_same_log_probs_bitwise_and_same_update(tiny_model_path, overrides):
    data = make_batch(rows=8, prompt_len=8, response_len=12, seed=3)
    bf16 = overrides.get("param_dtype") == "bf16"
    results = {}
    for on in (True, False):
        eng = engine(tiny_model_path, fused_cpu_ops=on, **overrides)
        assert (_fused_modules(eng) > 0) == on
        log_probs = eng.compute_log_prob(data, temperature=1.0, calculate_entropy=True)
        metrics = eng.train_step(data, pg_loss)
        results[on] = log_probs, metrics, params(eng)
    (l1, m1, p1), (l0, m0, p0) = results[True], results[False]
    assert torch.equal(l1["log_probs"], l0["log_probs"]) and torch.equal(l1["entropy"], l0["entropy"])
    # bf16: the fused backward rounds its gradients to bf16 once where torch's ops round after each op
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-3 if bf16 else 1e-5)
    if not bf16:  # Adam normalises each element: in bf16 a gradient's last bit can flip a tiny one's update
        assert max_diff(p1, p0) <= 1e-5  # (rounding moves small ones more)
    assert _fused_modules(engine(tiny_model_path, batch_invariant=True)) == 0
