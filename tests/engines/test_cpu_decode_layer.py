"""The fp32 decode-layer driver (engines/rollout/cpu_decode_layer.py, cpu_decode_layer.c): a decode step as one C
call, or two C calls a layer where the C activation is not torch's. An engine's tokens and log-probs are the same bits
with and without it on every dense architecture, with a shared (n > 1) and an unshared prompt cache, with rows
stopping and being compacted mid-call, and after a weight update; the C SiLU and GELU-tanh are torch's bit for bit;
routed-experts (MoE) layers run their experts as one C call with the same bits; it is not used where its kernels do
not all run (bf16, without the attention kernel), and those engines still generate. The decode loop in C gives the
Python loop's bits. In bf16 the C gate is torch's bit for bit, and the eager steps that take it (with the fused
residual norms of cpu_step_ops) give the op-by-op steps' bits."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from hybridflow.engines.rollout import SamplingParams, cpu_bf16_step, cpu_decode_layer, create_rollout_engine
from hybridflow.engines.rollout.chunked_prefill import chunked_prefill
from hybridflow.engines.rollout.kv_cache import KVCache
from hybridflow.engines.tiny import SIZES, write_tiny_model
from hybridflow.protocol import DataProto

DENSE = ["qwen2", "qwen3", "llama", "mistral", "phi3", "gemma2", "gemma3_text"]


@pytest.fixture(scope="module")
def kernel():
    built = cpu_decode_layer.load()
    assert built is not None, "the decode-layer driver did not build on this machine (see the log warning)"
    return built


def _engine(path: str, **kwargs):
    """An fp32 native engine on the panel kernel, which the driver needs (asked for: the default takes it wherever
    it builds, and these tests are about the driver, not that default)."""
    return create_rollout_engine("native", path, dtype="fp32", seed=3, linear_kernel=True, **kwargs)


def _prompts(engine) -> DataProto:
    enc = engine.tokenizer(["a b c", "d", "e f g h i j k l"], return_tensors="pt", padding=True, padding_side="left")
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                                "position_ids": (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)})


PARAMS = [
    SamplingParams(greedy=True, max_new_tokens=10),  # n = 1: one cache segment per row
    SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=11),  # shared prompt part + generated part
    # rows stop early and are compacted: the running rows (and the structs' row count) change within the call
    SamplingParams(temperature=1.0, max_new_tokens=16, n=4, seed=5, stop_token_ids=list(range(40, 140))),
]


def _generate(engine, layer_kernel, calls: dict | None = None):
    """The engine's outputs for PARAMS; with `calls`, counts the decode steps that ran as one call ("step") and
    those that ran two calls a layer ("layers")."""
    engine.model.layer_kernel = layer_kernel
    if layer_kernel is not None and calls is not None:
        real_step, real_layers = layer_kernel.step, layer_kernel.layers

        def step(*args, **kwargs):
            logits = real_step(*args, **kwargs)
            calls["step"] += logits is not None
            return logits

        def layers(*args, **kwargs):
            calls["layers"] += 1
            return real_layers(*args, **kwargs)

        layer_kernel.step, layer_kernel.layers = step, layers
    try:
        return [engine.generate(_prompts(engine), params) for params in PARAMS]
    finally:
        if layer_kernel is not None and calls is not None:
            del layer_kernel.step, layer_kernel.layers  # back to the class's methods


def _assert_same(with_kernel, without) -> None:
    for a, b in zip(with_kernel, without):
        for key in ("responses", "rollout_log_probs", "response_mask"):
            assert torch.equal(a.batch[key], b.batch[key]), key


@pytest.mark.parametrize("arch", DENSE)
def test_an_engine_gives_the_same_bits_with_and_without_the_layer_driver(kernel, tmp_path, arch):
    path = write_tiny_model(str(tmp_path / arch), "tiny", seed=0, arch=arch)
    engine = _engine(path)
    assert engine.model.layer_kernel is kernel and kernel.applies(engine.model)
    calls = {"step": 0, "layers": 0}
    with_kernel = _generate(engine, kernel, calls)
    # SiLU and GELU-tanh MLPs: the whole step as one call (its activation checked against torch's first; where
    # torch's vector function is found, the C activation must be torch's bit for bit)
    s = engine.model.shape
    assert s.activation in ("silu", "gelu_pytorch_tanh")
    assert cpu_decode_layer.torch_vector_function("exp") is not None, torch.backends.cpu.get_cpu_capability()
    assert kernel.activation_variant(s.activation, s.intermediate_size, torch.get_num_threads()) is not None
    assert calls["step"] > 0 and calls["layers"] == 0, calls
    _assert_same(with_kernel, _generate(engine, None))
    # rows did stop and were compacted in the third call
    assert (with_kernel[2].batch["response_mask"].sum(-1) < 16).any()


def _count_loop_runs(monkeypatch) -> list[int]:
    """Counts the runs of the decode loop in C (cpu_decode_layer.DecodeLoop.run)."""
    count, real = [0], cpu_decode_layer.DecodeLoop.run

    def run(self, *args, **kwargs):
        count[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cpu_decode_layer.DecodeLoop, "run", run)
    return count


# PARAMS, plus a temperature and a call longer than the draws the loop is given at once (sampling.StepUniforms'
# tables of 64 steps): the loop returns for the next table and goes on
LOOP_PARAMS = [*PARAMS, SamplingParams(temperature=0.7, max_new_tokens=150, n=2, seed=8),
               SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=12, n=2, seed=4),  # top-p, and top-k below
               SamplingParams(temperature=1.0, top_k=5, top_p=0.95, max_new_tokens=12, n=3, seed=6)]


@pytest.mark.parametrize("arch,window", [("qwen2", None), ("mistral", 5), ("gemma3_text", 6)])
def test_the_decode_loop_in_c_gives_the_python_loops_bits(kernel, tmp_path, monkeypatch, arch, window):
    """The loop in C (choose, record, stop and decode without returning to Python between steps) against the Python
    loop over the same one-call steps: the same tokens, log-probs and lengths, greedy and sampled (with top-k and
    top-p too), with an unshared and a shared prompt cache, with rows stopping and being dropped mid-call (the loop
    returns, the rows are dropped, it runs again on the rest), past its first table of draws, and with sliding
    windows that cut into the prompt."""
    spec = dataclasses.replace(SIZES["tiny"], sliding_window=window)
    engine = _engine(write_tiny_model(str(tmp_path / arch), spec, seed=0, arch=arch))
    runs = _count_loop_runs(monkeypatch)
    in_c = [engine.generate(_prompts(engine), params) for params in LOOP_PARAMS]
    assert runs[0] > len(LOOP_PARAMS)  # every call ran it, and it ran again after the rows were dropped
    assert (in_c[2].batch["response_mask"].sum(-1) < 16).any()
    assert in_c[3].batch["responses"].shape[1] == 150
    monkeypatch.setattr(kernel, "loop", lambda *args, **kwargs: None)  # the Python loop
    _assert_same(in_c, [engine.generate(_prompts(engine), params) for params in LOOP_PARAMS])


def test_a_weight_update_is_read_by_the_next_steps(kernel, tmp_path):
    path = write_tiny_model(str(tmp_path / "qwen3"), "tiny", seed=0, arch="qwen3")
    engine = _engine(path)
    assert kernel.applies(engine.model)
    _generate(engine, kernel)  # the driver's structs now point at the packed weights of the first load
    other = write_tiny_model(str(tmp_path / "other"), "tiny", seed=1, arch="qwen3")
    from safetensors.torch import load_file
    engine.update_weights(load_file(f"{other}/model.safetensors").items())
    fresh = _engine(other)
    fresh.model.layer_kernel = None
    _assert_same(_generate(engine, kernel), _generate(fresh, None))


def test_it_is_not_used_where_its_kernels_do_not_all_run(kernel, tmp_path):
    path = write_tiny_model(str(tmp_path / "qwen2"), "tiny", seed=0, arch="qwen2")
    bf16 = create_rollout_engine("native", path, dtype="bf16", seed=3)
    assert not kernel.applies(bf16.model)  # bf16: only the MLP gate (cpu_bf16_step.py)
    fp32 = _engine(path, attention_kernel=False)
    assert not kernel.applies(fp32.model)  # the attention as torch matmuls: the eager layers run
    _generate(fp32, kernel)


def _moe_model(tmp_path, k: int) -> str:
    """A tiny Qwen3-MoE (4 experts) routing each token to k of them; k = 3 without renormalised weights, so that a
    token sums three experts' outputs, where the order of the sum shows."""
    path = write_tiny_model(str(tmp_path / f"moe{k}"), "tiny", seed=0, arch="qwen3_moe")
    if k != 2:
        config = json.loads(Path(path, "config.json").read_text())
        config |= {"num_experts_per_tok": k, "norm_topk_prob": False}
        Path(path, "config.json").write_text(json.dumps(config))
    return path


def _count_routed(monkeypatch, kernel) -> list[int]:
    """Counts the routed-experts layers that ran as one C call."""
    count, real = [0], kernel._moe_out

    def moe_out(*args):
        count[0] += 1
        return real(*args)

    monkeypatch.setattr(kernel, "_moe_out", moe_out)
    return count


@pytest.mark.parametrize("k", [2, 3])
def test_a_routed_experts_model_gives_the_same_bits_with_its_experts_in_c(kernel, tmp_path, monkeypatch, k):
    """Qwen3-MoE: each routed layer's experts as one C call (the router in torch between the layer's calls) give
    moe.py's dispatch's bits, tokens, log-probs and the routes recorded for routing replay."""
    engine = _engine(_moe_model(tmp_path, k), record_routes=True)
    assert engine.model.shape.experts_per_token == k and kernel.applies(engine.model)
    calls, routed = {"step": 0, "layers": 0}, _count_routed(monkeypatch, kernel)
    with_kernel = _generate(engine, kernel, calls)
    assert calls["step"] == 0 and calls["layers"] > 0 and routed[0] > 0, (calls, routed)
    without = _generate(engine, None)
    _assert_same(with_kernel, without)
    for a, b in zip(with_kernel, without):
        assert torch.equal(a.batch["routed_experts"], b.batch["routed_experts"])
        assert (a.batch["routed_experts"] >= 0).any()


def test_a_routed_experts_model_keeps_torchs_dispatch_where_the_c_gate_differs(kernel, tmp_path, monkeypatch):
    engine = _engine(_moe_model(tmp_path, 2))
    s = engine.model.shape
    key = (s.activation, s.moe_intermediate_size, torch.get_num_threads(), torch.float32)
    one_call = _generate(engine, kernel)
    monkeypatch.setitem(kernel._act_checked, key, None)
    routed = _count_routed(monkeypatch, kernel)
    _assert_same(one_call, _generate(engine, kernel))
    assert routed[0] == 0


def test_the_kept_step_buffers_follow_the_rows_threads_and_length(kernel, tmp_path):
    """The driver keeps its work buffers between steps and calls (cpu_decode_layer.DecodeLayerKernel._step): a call
    with more rows, one on another thread count and one whose keys outgrow the attention's scratch get new ones."""
    path = write_tiny_model(str(tmp_path / "qwen2"), "tiny", seed=0, arch="qwen2")
    engine = _engine(path)
    assert kernel.applies(engine.model)
    calls = [SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1),
             SamplingParams(temperature=1.0, max_new_tokens=8, n=5, seed=2),  # more rows
             SamplingParams(temperature=1.0, max_new_tokens=300, n=1, seed=4)]  # past the scratch's first 256 keys
    before = torch.get_num_threads()
    outputs = {}
    try:
        for layer_kernel in (kernel, None):
            engine.model.layer_kernel = layer_kernel
            got = []
            for threads in (2, 1):
                torch.set_num_threads(threads)
                got += [engine.generate(_prompts(engine), params) for params in calls]
            outputs[layer_kernel is None] = got
    finally:
        torch.set_num_threads(before)
        engine.model.layer_kernel = kernel
    assert outputs[False][-1].batch["responses"].shape[1] == 300
    _assert_same(outputs[False], outputs[True])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_the_c_activation_is_torchs_bit_for_bit(kernel, activation, threads):
    """act_mul_f32 against torch's ``act(gate).mul_(up)`` on a fused gate/up buffer: widths with and without a
    scalar tail, row counts below and above torch's parallel thresholds (where torch splits a row between its
    threads)."""
    kind, name = cpu_decode_layer._ACTIVATIONS[activation]
    vector = cpu_decode_layer.torch_vector_function(name)
    assert vector is not None, f"no vector {name} found for torch's {torch.backends.cpu.get_cpu_capability()} kernels"
    fma = kernel.activation_variant(activation, 512, threads)
    assert fma is not None
    torch_act = (torch.nn.functional.silu if activation == "silu"
                 else functools.partial(torch.nn.functional.gelu, approximate="tanh"))
    g = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for inter in (7, 100, 512, 1000, 1536):
            for rows in (1, 5, 17, 33, 64, 65, 127, 200):
                gate_up = torch.randn(rows, 2 * inter, generator=g) * 12.0
                want = torch_act(gate_up[:, :inter]).mul_(gate_up[:, inter:])
                got = torch.empty(rows, inter)
                assert kernel._act(kind, fma, vector[0], vector[1], gate_up.data_ptr(), rows, inter, got.data_ptr(),
                                   threads) == 0
                assert torch.equal(got, want), (inter, rows)
    finally:
        torch.set_num_threads(before)


def test_without_a_matching_activation_the_layers_run_two_calls_each(kernel, tmp_path):
    """Where the C activation is not torch's (activation_variant None), the steps take the two-call path with
    torch's activation: the same bits again."""
    path = write_tiny_model(str(tmp_path / "llama"), "tiny", seed=0, arch="llama")
    engine = _engine(path)
    key = ("silu", engine.model.shape.intermediate_size, torch.get_num_threads(), torch.float32)
    assert kernel.activation_variant(*key) is not None
    one_call = _generate(engine, kernel)
    kernel._act_checked[key] = None
    try:
        calls = {"step": 0, "layers": 0}
        two_calls = _generate(engine, kernel, calls)
    finally:
        del kernel._act_checked[key]
    assert calls["step"] == 0 and calls["layers"] > 0, calls
    _assert_same(one_call, two_calls)


def test_a_token_outside_the_embedding_is_an_index_error(kernel, tmp_path):
    from hybridflow.engines.rollout.native_rollout import _EagerSteps

    path = write_tiny_model(str(tmp_path / "qwen2"), "tiny", seed=0, arch="qwen2")
    engine = _engine(path)
    batch = _prompts(engine).batch
    steps = _EagerSteps(engine, batch["input_ids"], batch["position_ids"], batch["attention_mask"], 1, 4)
    vocab = engine.model.embed.shape[0]
    tokens = torch.tensor([1, vocab + 3, 2])
    with pytest.raises(IndexError, match="outside the embedding"):
        steps.decode(tokens, batch["position_ids"][:, -1] + 1, 0)


def test_scaled_embeddings_take_the_same_bits_in_one_call(kernel, tmp_path):
    """The one-call step scales the embedding rows as the eager step's ``x * embed_scale`` does (no SiLU model scales
    them in transformers today; the path is there for one that does)."""
    path = write_tiny_model(str(tmp_path / "qwen2"), "tiny", seed=0, arch="qwen2")
    engine = _engine(path)
    engine.model.embed_scale = torch.tensor(1.7)
    calls = {"step": 0, "layers": 0}
    one_call = _generate(engine, kernel, calls)
    assert calls["step"] > 0
    _assert_same(one_call, _generate(engine, None))
    engine.model.embed_scale = None
    assert not torch.equal(_generate(engine, kernel)[1].batch["rollout_log_probs"],
                           one_call[1].batch["rollout_log_probs"])  # the scale did change the outputs


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows,inter", [(1, 100), (16, 1536), (33, 1000), (64, 1536)])  # tails; split over threads
def test_the_bf16_gate_is_torchs_bit_for_bit(kernel, activation, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(torch.bfloat16)
    act = torch.nn.functional.silu if activation == "silu" else functools.partial(torch.nn.functional.gelu,
                                                                                   approximate="tanh")
    got = kernel.act_mul(gate_up, activation)
    assert got is not None, "the C gate differs from torch's here"
    assert torch.equal(got, act(gate_up[:, :inter]).mul_(gate_up[:, inter:]))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gemma3_text", "phi3"])
def test_bf16_steps_with_the_fused_norms_and_gate_are_the_same_bits(kernel, tmp_path, arch, monkeypatch):
    """The eager bf16 step with each residual add and the next norm as one call and the gate as one
    (cpu_bf16_step.layers) against the same engine's op-by-op step. (Where the whole step is one C call,
    cpu_bf16_step.step, that is compared with `layers` in test_cpu_bf16_linear.py; here it is off.)"""
    monkeypatch.setattr(cpu_bf16_step, "step", lambda *args: None)
    path = write_tiny_model(str(tmp_path / arch), dataclasses.replace(SIZES["tiny"], arch=arch), seed=0)
    engine = create_rollout_engine("native", path, dtype="bf16", seed=3)
    assert engine.model.layer_kernel is kernel and not kernel.applies(engine.model)
    fused = [engine.generate(_prompts(engine), params) for params in PARAMS]
    calls = {"steps": 0, "heads": 0}
    real, real_heads = cpu_bf16_step.layers, engine.model.step_ops.qkv_heads

    def counted(*args):
        calls["steps"] += 1
        return real(*args)

    def heads(*args):
        calls["heads"] += 1
        return real_heads(*args)

    monkeypatch.setattr(cpu_bf16_step, "layers", counted)
    monkeypatch.setattr(engine.model.step_ops, "qkv_heads", heads)
    engine.generate(_prompts(engine), PARAMS[0])
    monkeypatch.setattr(cpu_bf16_step, "layers", real)
    monkeypatch.setattr(engine.model.step_ops, "qkv_heads", real_heads)
    assert calls["steps"] > 0 and calls["heads"] == calls["steps"] * engine.model.shape.num_layers
    engine.model.layer_kernel = None
    for want, params in zip(fused, PARAMS):
        got = engine.generate(_prompts(engine), params)
        assert torch.equal(got.batch["responses"], want.batch["responses"])
        assert torch.equal(got.batch["rollout_log_probs"], want.batch["rollout_log_probs"])


def _prompt_batches(engine) -> tuple:
    """Two prompts left-padded to one length, and two of equal length (the padded prefill runs for those)."""
    return (engine.tokenizer(["a b c", "e f g h i j k l"], return_tensors="pt", padding=True, padding_side="left"),
            engine.tokenizer(["a b c d", "e f g h"], return_tensors="pt"))


def _prefill(engine, batch, dtype: torch.dtype) -> tuple[torch.Tensor, KVCache]:
    """The engine's prefill of `batch` into a fresh cache: (the prompts' last logits, the cache)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    s = engine.model.shape
    cache = KVCache(s.num_layers, s.num_kv_heads, s.head_dim, prompts=ids.shape[0], prompt_len=ids.shape[1], n=1,
                    max_new=1, dtype=dtype, device=torch.device("cpu"))
    return chunked_prefill(engine.model, ids, (mask.cumsum(-1) - 1).clamp(min=0), mask, cache, None), cache


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "qwen3_moe"])
def test_a_bf16_prefill_runs_the_fused_layers_and_follows_torchs_ops(kernel, tmp_path, arch, monkeypatch):
    """The bf16 prefill (packed, and padded where no prompt is padded) with the decode step's C calls
    (NativeDecoder.prompt_layers) against the same engine's prefill in torch's ops: the C norm may round a value the
    other way from torch's (test_cpu_step_ops.py), so the prompt's last logits agree to bf16 rounding."""
    path = write_tiny_model(str(tmp_path / arch), dataclasses.replace(SIZES["tiny"], arch=arch), seed=0)
    engine = create_rollout_engine("native", path, dtype="bf16", seed=3)
    calls, real = {"fused": 0}, cpu_bf16_step.layers

    def counted(*args):
        calls["fused"] += 1
        return real(*args)

    monkeypatch.setattr(cpu_bf16_step, "layers", counted)
    for batch in _prompt_batches(engine):
        logits = []
        for layer_kernel in (kernel, None):
            engine.model.layer_kernel = layer_kernel
            logits.append(_prefill(engine, batch, torch.bfloat16)[0])
        engine.model.layer_kernel = kernel
        torch.testing.assert_close(logits[0], logits[1], atol=0.05, rtol=0.02)
    assert calls["fused"] == 2


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3_text", "phi3"])
def test_an_fp32_prefill_with_the_step_ops_is_torchs_bit_for_bit(tmp_path, arch, monkeypatch):
    """The fp32 prefill (packed and padded) runs its norms and rotations through the decode step's C kernels
    (cpu_step_ops.py, NativeDecoder.prompt_layers): the same logits and stored K/V as torch's ops."""
    path = write_tiny_model(str(tmp_path / arch), dataclasses.replace(SIZES["tiny"], arch=arch), seed=0)
    engine = create_rollout_engine("native", path, dtype="fp32", seed=3)
    ops = engine.model.step_ops
    assert ops is not None and ops.f32_lanes is not None
    calls, real = {"norms": 0}, ops.rms_norm

    def counted(*args):
        calls["norms"] += 1
        return real(*args)

    monkeypatch.setattr(ops, "rms_norm", counted)
    for batch in _prompt_batches(engine):
        results = []
        for step_ops in (ops, None):
            engine.model.step_ops = step_ops
            results.append(_prefill(engine, batch, torch.float32))
        engine.model.step_ops = ops
        (fused, fused_cache), (torch_ops, torch_cache) = results
        assert torch.equal(fused, torch_ops)
        P = batch["input_ids"].shape[1]  # the prompts' columns (past them: the generated tokens', not written here)
        for li in range(engine.model.shape.num_layers):
            assert torch.equal(fused_cache.keys[li][..., :P], torch_cache.keys[li][..., :P])
            assert torch.equal(fused_cache.values[li][:, :, :P], torch_cache.values[li][:, :, :P])
    assert calls["norms"] > 0
