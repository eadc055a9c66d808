"""The decode step's small-op kernels (engines/rollout/cpu_step_ops.py, cpu_step_ops.c): the rotary embedding is
native_model._rotate bit for bit in fp32 and bf16 (strided q/k views of the fused projection, partial rotary dims, one
thread and split over threads); the fp32 RMSNorm is native_model._rms_norm bit for bit (torch's order of summing the
squares), and is not used where that cannot be reproduced; the bf16 RMSNorm is native_model._rms_norm up to one ulp
at rare rounding boundaries (Llama's and Gemma's order); an engine's outputs are the same bits with and without the
kernels in fp32, and its greedy tokens the same in bf16. The bf16 decode step's residual add and the norm after it
(add_rms_norm) are torch's bf16 add and the norm kernel, and its attention inputs (qkv_heads) the per-head norms and
the rotation, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridflow.engines.rollout import SamplingParams, c_kernels, cpu_step_ops, create_rollout_engine
from hybridflow.engines.rollout.native_model import _rms_norm, _rotate
from hybridflow.engines.rollout.rope import RotaryTables
from hybridflow.engines.tiny import write_tiny_model
from hybridflow.protocol import DataProto


@pytest.fixture(scope="module")
def kernel():
    built = cpu_step_ops.load()
    assert built is not None, "the step-op kernels did not build on this machine (see the log warning)"
    return built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# rows x heads x head_dim: one thread below 32768 elements, split over threads above
@pytest.mark.parametrize("rows,heads,D,dim", [(5, 3, 16, 16), (16, 6, 32, 32), (7, 4, 80, 40), (64, 12, 64, 64)])
def test_the_rotation_is_rotate_bit_for_bit(kernel, dtype, rows, heads, D, dim):
    g = torch.Generator().manual_seed(rows + D)
    positions_total = 50
    cos = torch.randn(positions_total, dim, generator=g).to(dtype)
    sin = torch.randn(positions_total, dim, generator=g).to(dtype)
    assert kernel.reads_tables(RotaryTables({"default": cos}, {"default": sin}, dim, None))
    # a strided view, as the q/k heads of the fused qkv projection are
    fused = torch.randn(rows, heads * D + 24, generator=g).to(dtype)
    x = fused[:, : heads * D].view(rows, heads, D)
    assert kernel.rotates(x, cos)
    positions = torch.randint(0, positions_total, (rows,), generator=g)
    want = _rotate(x, cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2))
    got = kernel.rotate(x, cos, sin, positions)
    assert got.is_contiguous() and got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("offset", [False, True])  # Llama's order (w * bf16(v)); Gemma's (bf16(v * (1 + w)))
@pytest.mark.parametrize("shape", [(64, 512), (16, 6, 128), (3, 7)])
def test_the_bf16_norm_is_torchs_up_to_rare_rounding_ties(kernel, offset, shape):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    weight = (torch.randn(shape[-1], generator=g) * 0.2 + 1).to(torch.bfloat16)
    assert kernel.normalises(x, weight)
    got = kernel.rms_norm(x, weight, 1e-6, offset)
    want = _rms_norm(x, weight, 1e-6, offset)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    differ = got != want
    assert differ.float().mean() < 1e-3, int(differ.sum())
    # where they differ, by one bf16 ulp of the value (2^-7 relative, at most)
    assert torch.all((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-30)
    # a strided input (the q heads of a fused projection) reads the same rows
    wide = torch.cat([x, x], -1)
    assert torch.equal(kernel.rms_norm(wide[..., : shape[-1]], weight, 1e-6, offset), got)


# rows of one vector and less (torch's scalar sum), around the vector widths, the mid model's q/k heads and hidden
# size, past the sum's first cascade level, and a row split over threads
@pytest.mark.parametrize("shape", [(5, 7), (3, 8), (4, 17), (16, 8, 64), (64, 512), (7, 1000), (3, 4097), (2, 32_767)])
@pytest.mark.parametrize("offset", [False, True])
def test_the_fp32_norm_is_torchs_bit_for_bit(kernel, shape, offset):
    assert kernel.f32_lanes is not None, "no vector width reproduced torch's fp32 sum on this machine"
    g = torch.Generator().manual_seed(shape[-1])
    for scale in (1e-3, 1.0, 40.0):
        x = torch.randn(*shape, generator=g) * scale
        weight = torch.randn(shape[-1], generator=g) * 0.2 + 1
        assert kernel.normalises(x, weight)
        want = _rms_norm(x, weight, 1e-6, offset)
        assert torch.equal(kernel.rms_norm(x, weight, 1e-6, offset), want)
        # a strided input (the q heads of a fused projection) reads the same rows
        wide = torch.cat([x, x], -1)
        assert torch.equal(kernel.rms_norm(wide[..., : shape[-1]], weight, 1e-6, offset), want)


def test_the_fp32_norm_is_not_used_where_torchs_bits_cannot_be_reproduced(monkeypatch):
    lib = c_kernels.load_library(cpu_step_ops._SOURCE, "step_ops", "rotary and RMSNorm", "torch's ops",
                                 fast_math=False, extra_flags=("-ffp-contract=off",))
    # a torch whose norm rounds differently (one ulp up everywhere) than any summing order of the kernel
    torch_norm = F.rms_norm
    monkeypatch.setattr(cpu_step_ops.F, "rms_norm", lambda *args: torch.nextafter(torch_norm(*args),
                                                                                     torch.tensor(float("inf"))))
    built = cpu_step_ops.StepOpsKernel(lib)
    assert built.f32_lanes is None
    assert not built.normalises(torch.randn(4, 8), torch.ones(8))
    assert built.normalises(torch.randn(4, 8).to(torch.bfloat16), torch.ones(8, dtype=torch.bfloat16))


def test_what_the_kernels_do_not_take_is_refused(kernel):
    cos = torch.randn(8, 6)
    assert not kernel.reads_tables(RotaryTables({"default": cos.double()}, {"default": cos.double()}, 6, None))
    assert not kernel.reads_tables(RotaryTables({"default": cos[:, :5]}, {"default": cos[:, :5]}, 5, None))
    assert not kernel.rotates(torch.randn(4, 2, 8).to(torch.bfloat16), cos)  # not the table's dtype
    assert not kernel.rotates(torch.randn(4, 8, 2).transpose(1, 2), cos)  # last dimension strided
    assert kernel.rotates(torch.randn(4, 2, 8), cos)
    assert not kernel.normalises(torch.randn(4, 8), torch.ones(8, dtype=torch.bfloat16))  # not the weight's dtype
    assert not kernel.normalises(torch.randn(4, 8, 2).transpose(1, 2), torch.ones(2))  # last dimension strided
    assert not kernel.normalises(torch.randn(1, 32768), torch.ones(32768))  # a row torch may split between threads
    assert kernel.normalises(torch.randn(4, 8).to(torch.bfloat16), torch.ones(8, dtype=torch.bfloat16))


def _outputs(engine, ops):
    engine.model.step_ops = ops
    enc = engine.tokenizer(["a b c", "d", "e f g h i j"], return_tensors="pt", padding=True, padding_side="left")
    batch = DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                                 "position_ids": (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)})
    return [engine.generate(batch, params) for params in (
        SamplingParams(greedy=True, max_new_tokens=12), SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=11))]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2"])  # q and k rotated together; q/k norms; Gemma's norms
def test_an_engine_gives_the_same_outputs_with_and_without_the_kernels(kernel, tmp_path, arch):
    path = write_tiny_model(str(tmp_path / arch), "tiny", seed=0, arch=arch)
    fp32 = create_rollout_engine("native", path, dtype="fp32", seed=3)
    assert fp32.model.step_ops is kernel
    for with_kernel, without in zip(_outputs(fp32, kernel), _outputs(fp32, None)):
        assert torch.equal(with_kernel.batch["responses"], without.batch["responses"])
        assert torch.equal(with_kernel.batch["rollout_log_probs"], without.batch["rollout_log_probs"])
    bf16 = create_rollout_engine("native", path, dtype="bf16", seed=3)
    assert bf16.model.step_ops is kernel
    greedy_k, _ = _outputs(bf16, kernel)
    greedy_t, _ = _outputs(bf16, None)
    assert torch.equal(greedy_k.batch["responses"], greedy_t.batch["responses"])


@pytest.mark.parametrize("sandwich", [False, True])  # Gemma: the block output normalised before the add
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("shape", [(16, 512), (64, 512), (5, 100)])  # one thread, split over threads, a tail
def test_the_bf16_residual_and_norm_are_torchs_add_and_the_norm_kernel(kernel, sandwich, offset, shape):
    g = torch.Generator().manual_seed(shape[0] + 2 * sandwich + offset)
    x, y = ((torch.randn(*shape, generator=g) * 3).to(torch.bfloat16) for _ in range(2))
    w, yw = ((torch.randn(shape[-1], generator=g) * 0.2 + 1).to(torch.bfloat16) for _ in range(2))
    block = kernel.rms_norm(y, yw, 1e-6, offset) if sandwich else y
    want_x = x + block  # torch's bf16 add
    want_h = kernel.rms_norm(want_x, w, 1e-6, offset)
    h = kernel.add_rms_norm(x, y, yw if sandwich else None, w, 1e-6, offset)
    assert torch.equal(x, want_x) and torch.equal(h, want_h)  # x updated in place


def test_the_bf16_residual_refuses_mixed_or_strided_rows(kernel):
    x, w = torch.zeros(4, 32, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous bf16 rows"):
        kernel.add_rms_norm(x, torch.zeros(4, 64, dtype=torch.bfloat16)[:, ::2], None, w, 1e-6, False)
    with pytest.raises(ValueError, match="contiguous bf16 rows"):
        kernel.add_rms_norm(x, torch.zeros(4, 32), None, w, 1e-6, False)


@pytest.mark.parametrize("qk_norm", [False, True])  # Qwen3 / Gemma 3: q and k normalised per head first
@pytest.mark.parametrize("rows,heads,kv,D,dim", [(5, 4, 2, 32, 32), (64, 8, 4, 64, 64), (3, 6, 6, 80, 40)])
def test_the_bf16_attention_inputs_are_the_norms_and_rotation_bit_for_bit(kernel, qk_norm, rows, heads, kv, D, dim):
    g = torch.Generator().manual_seed(rows + D + qk_norm)
    bf = torch.bfloat16
    qkv = (torch.randn(rows, (heads + 2 * kv) * D + 8, generator=g) * 2).to(bf)[:, : (heads + 2 * kv) * D]  # strided
    cos, sin = (torch.randn(100, dim, generator=g).to(bf) for _ in range(2))
    qn, kn = ((torch.randn(D, generator=g) * 0.2 + 1).to(bf) for _ in range(2))
    positions = torch.randint(0, 100, (rows,), generator=g)
    q_in, k_in = qkv[:, : heads * D].view(rows, heads, D), qkv[:, heads * D : (heads + kv) * D].view(rows, kv, D)
    if qk_norm:
        q_in, k_in = kernel.rms_norm(q_in, qn, 1e-6, False), kernel.rms_norm(k_in, kn, 1e-6, False)
    want = (kernel.rotate(q_in, cos, sin, positions), kernel.rotate(k_in, cos, sin, positions),
            qkv[:, (heads + kv) * D :].reshape(rows, kv, D))
    got = kernel.qkv_heads(qkv, heads, kv, qn if qk_norm else None, kn if qk_norm else None, 1e-6, False, cos, sin,
                           positions)
    for a, b in zip(got, want):
        assert a.is_contiguous() and torch.equal(a, b)
