"""The native rollout's oneDNN-packed fp32 and bf16 weights (CPU): the same function as F.linear (bitwise in bf16),
used by default on CPU, and the decode with and without packing gives the same tokens and log-probs."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_rollout_engines import make_prompts, write_model

from hybridflow import device
from hybridflow.engines.rollout import SamplingParams, cpu_bf16_linear, cpu_linear, create_rollout_engine
from hybridflow.engines.rollout.native_model import NativeDecoder
from hybridflow.engines.rollout.onednn_linear import (
    MIN_PACKED_WIDTH,
    native_bf16,
    onednn_available,
    onednn_linear,
    pack_onednn,
)
from hybridflow.engines.tiny import SIZES, make_config

pytestmark = [
    pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN linear ops; the decoder uses F.linear"),
    pytest.mark.skipif(device.is_cuda_available(), reason="a CPU-only path: on GPUs the rollout computes on the GPU"),
]


def test_packed_linear_is_f_linear_up_to_rounding_and_row_independent():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    packed = pack_onednn(w)
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 80, generator=g)
        want = F.linear(x.double(), w.double(), b.double()).float()
        torch.testing.assert_close(onednn_linear(x, packed, b), want, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(onednn_linear(x, packed, None), want - b, atol=1e-4, rtol=1e-5)
    x = torch.randn(33, 80, generator=g)
    full = onednn_linear(x, packed, b)
    # a row's result does not depend on the other rows of the batch (batch-invariant decoding)
    assert torch.equal(full[5:6], onednn_linear(x[5:6], packed, b))
    assert torch.equal(onednn_linear(x.view(3, 11, 80), packed, b).view(33, 96), full)


def test_cpu_fp32_decoder_packs_from_hidden_size_256_by_default():
    def decoder(size: str, **kwargs) -> NativeDecoder:
        return NativeDecoder(make_config(SIZES[size]), torch.float32, torch.device("cpu"), 64, **kwargs)

    # fp32 packed weights run on the panel kernel (cpu_linear.py) where it builds, else on oneDNN
    packed = "panel" if cpu_linear.kernel_for(None) is not None else "onednn"
    assert SIZES["mid"].hidden_size >= MIN_PACKED_WIDTH > SIZES["unit"].hidden_size
    assert decoder("mid").matmul == packed and decoder("unit").matmul == "dense"
    assert decoder("unit", prepack=True).matmul == packed and decoder("mid", prepack=False).matmul == "dense"
    assert decoder("mid", linear_kernel=False).matmul == "onednn"
    # the panel kernel pays from hidden size 128 (cpu_linear.MIN_PANEL_WIDTH), oneDNN's packing from 256
    assert decoder("tiny").matmul == ("panel" if packed == "panel" else "dense")
    assert decoder("tiny", linear_kernel=False).matmul == "dense"


@pytest.mark.parametrize("linear_kernel", [None, False])
def test_packed_decoder_matches_the_unpacked_one(tmp_path, linear_kernel):
    path = write_model(tmp_path / "llama", "llama", seed=3, tie=False)  # untied head: the packed lm_head is used
    packed = create_rollout_engine("native", path, num_threads=1, prepack=True, linear_kernel=linear_kernel)
    plain = create_rollout_engine("native", path, num_threads=1, prepack=False)
    kernel = "panel" if linear_kernel is None and cpu_linear.kernel_for(None) is not None else "onednn"
    assert packed.model.matmul == kernel and plain.model.matmul == "dense"
    prompts = make_prompts(packed.tokenizer)
    for params in (SamplingParams(greedy=True, max_new_tokens=16),
                   SamplingParams(temperature=1.0, n=3, max_new_tokens=16, seed=4)):
        a, b = packed.generate(prompts, params), plain.generate(prompts, params)
        assert torch.equal(a.batch["responses"], b.batch["responses"])
        torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5, rtol=0)


def test_int8_does_not_use_the_onednn_packing_and_bf16_only_with_bf16_units(tmp_path):
    path = write_model(tmp_path / "qwen2", "qwen2", seed=0)
    assert create_rollout_engine("native", path, dtype="int8").model.matmul == "int8"
    with warnings.catch_warnings():  # "bf16 is emulated" on CPUs without bf16 units
        warnings.simplefilter("ignore")
        bf16 = create_rollout_engine("native", path, dtype="bf16", prepack=True)
    assert bf16.model.matmul == ("bf16_tiles" if cpu_bf16_linear.load() else "onednn" if native_bf16() else "dense")
    assert onednn_available(torch.bfloat16) == native_bf16()


needs_bf16_units = pytest.mark.skipif(not native_bf16(), reason="bf16 is packed only on CPUs with AVX512-BF16/AMX")


@needs_bf16_units
def test_bf16_packed_linear_is_f_linear_bitwise():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 80, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    packed = pack_onednn(w)
    assert packed.dtype == torch.bfloat16
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 80, generator=g).bfloat16()
        assert torch.equal(onednn_linear(x, packed, b), F.linear(x, w, b))
        assert torch.equal(onednn_linear(x, packed, None), F.linear(x, w))


@needs_bf16_units
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("matmul", ["onednn", "bf16_tiles"])
def test_bf16_packed_decoder_is_the_unpacked_one(tmp_path, arch, matmul):
    """Packing changes the layout, not the bf16 arithmetic: same tokens and bitwise the same log-probs (the bf16
    tiles, AMX's or AVX512-BF16's: at these row counts their sums are oneDNN's)."""
    if matmul == "bf16_tiles" and cpu_bf16_linear.load() is None:
        pytest.skip("no bf16 tile kernel here: the bf16 decoder packs for oneDNN")
    path = write_model(tmp_path / arch, arch, seed=3, tie=False)  # untied head: the packed lm_head is used
    packed = create_rollout_engine("native", path, dtype="bf16", num_threads=1, prepack=True,
                                   linear_kernel=matmul == "bf16_tiles")
    plain = create_rollout_engine("native", path, dtype="bf16", num_threads=1, prepack=False)
    assert packed.model.matmul == matmul and plain.model.matmul == "dense"
    prompts = make_prompts(packed.tokenizer)
    for params in (SamplingParams(greedy=True, max_new_tokens=16),
                   SamplingParams(temperature=1.0, n=3, max_new_tokens=16, seed=4)):
        a, b = packed.generate(prompts, params), plain.generate(prompts, params)
        assert torch.equal(a.batch["responses"], b.batch["responses"])
        assert torch.equal(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"])
