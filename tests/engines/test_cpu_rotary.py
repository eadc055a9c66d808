"""The decode step's rotary kernel (engines/rollout/cpu_rotary.py, cpu_rotary.c): native_model._rotate bit for bit
(strided q/k views of the fused projection, partial rotary dims, one thread and split over threads), and an engine's
greedy and sampled outputs the same bits with and without it."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout import SamplingParams, cpu_rotary, create_rollout_engine
from hybridflow.engines.rollout.native_model import _rotate
from hybridflow.engines.rollout.rope import RotaryTables
from hybridflow.engines.tiny import write_tiny_model
from hybridflow.protocol import DataProto


@pytest.fixture(scope="module")
def kernel():
    built = cpu_rotary.load()
    assert built is not None, "the rotary kernel did not build on this machine (see the log warning)"
    return built


# rows x heads x head_dim: one thread below 32768 elements, split over threads above
@pytest.mark.parametrize("rows,heads,D,dim", [(5, 3, 16, 16), (16, 6, 32, 32), (7, 4, 80, 40), (64, 12, 64, 64)])
def test_the_kernel_is_rotate_bit_for_bit(kernel, rows, heads, D, dim):
    g = torch.Generator().manual_seed(rows + D)
    positions_total = 50
    cos = torch.randn(positions_total, dim, generator=g)
    sin = torch.randn(positions_total, dim, generator=g)
    assert kernel.reads_tables(RotaryTables({"default": cos}, {"default": sin}, dim, None))
    # a strided view, as the q/k heads of the fused qkv projection are
    fused = torch.randn(rows, heads * D + 24, generator=g)
    x = fused[:, : heads * D].view(rows, heads, D)
    positions = torch.randint(0, positions_total, (rows,), generator=g)
    want = _rotate(x, cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2))
    got = kernel.rotate(x, cos, sin, positions)
    assert got.is_contiguous() and torch.equal(got, want)


def test_tables_or_rows_it_cannot_read_are_refused(kernel):
    cos = torch.randn(8, 6)
    assert not kernel.reads_tables(RotaryTables({"default": cos.double()}, {"default": cos.double()}, 6, None))
    assert not kernel.reads_tables(RotaryTables({"default": cos[:, :5]}, {"default": cos[:, :5]}, 5, None))
    assert not kernel.supports(torch.randn(4, 2, 8).to(torch.bfloat16))
    assert not kernel.supports(torch.randn(4, 8, 2).transpose(1, 2))
    assert kernel.supports(torch.randn(4, 2, 8))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q and k rotated together; after the per-head q/k norms
def test_an_engine_gives_the_same_bits_with_and_without_the_kernel(kernel, tmp_path, arch):
    path = write_tiny_model(str(tmp_path / arch), "tiny", seed=0, arch=arch)
    engine = create_rollout_engine("native", path, dtype="fp32", seed=3)
    assert engine.model.rotary_kernel is kernel
    enc = engine.tokenizer(["a b c", "d", "e f g h i j"], return_tensors="pt", padding=True, padding_side="left")
    batch = DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                                 "position_ids": (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)})
    outputs = []
    for rotary in (kernel, None):
        engine.model.rotary_kernel = rotary
        outputs.append([engine.generate(batch, params) for params in (
            SamplingParams(greedy=True, max_new_tokens=12),
            SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=11))])
    for with_kernel, without in zip(*outputs):
        assert torch.equal(with_kernel.batch["responses"], without.batch["responses"])
        assert torch.equal(with_kernel.batch["rollout_log_probs"], without.batch["rollout_log_probs"])
