"""engines/causal_attention.py: on CPU in bf16 with gradients the forward is SDPA's own bits and the backward, in
fp32, is at least as close to the fp64 gradient as the bf16 kernel's; elsewhere it is plain SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridflow.engines import causal_attention as ca


def _inputs(dtype, rows=3, length=21, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, length, 4, 16, generator=g)
    k, v = (torch.randn(rows, length, 2, 16, generator=g) for _ in range(2))
    # [b, heads, L, D] views of [b, L, heads, D], as the models give them
    return [t.to(dtype).transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("length", [1, 21, 70])
def test_bf16_forward_bits_and_a_backward_closer_to_fp64(length):
    weights = torch.randn(3, 4, length, 16, generator=torch.Generator().manual_seed(1))
    ours, theirs, exact = _inputs(torch.bfloat16, length=length), _inputs(torch.bfloat16, length=length), \
        _inputs(torch.float64, length=length)
    assert ca._fp32_backward(*ours, 0.0)
    out = ca.causal_attention(*ours, 0.0, None, True)
    ref = F.scaled_dot_product_attention(*theirs, is_causal=True, enable_gqa=True)
    fp64 = F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    (out.float() * weights).sum().backward()
    (ref.float() * weights).sum().backward()
    (fp64 * weights.double()).sum().backward()
    for a, b, e in zip(ours, theirs, exact):
        assert a.grad.dtype == torch.bfloat16 and a.grad.shape == a.shape
        err_ours = float((a.grad.double() - e.grad).abs().max())
        err_theirs = float((b.grad.double() - e.grad).abs().max())
        scale = max(float(e.grad.abs().max()), 1e-3)  # at length 1 the query gradient is zero up to rounding
        assert err_ours <= 2e-2 * scale and err_ours <= err_theirs * 1.05 + 1e-3 * scale, (err_ours, err_theirs)


def test_plain_sdpa_elsewhere():
    fp32 = _inputs(torch.float32)
    assert not ca._fp32_backward(*fp32, 0.0)
    bf16 = _inputs(torch.bfloat16)
    assert not ca._fp32_backward(*bf16, 0.1)  # dropout
    assert not ca._fp32_backward(bf16[0], bf16[1], bf16[2][..., :8], 0.0)  # values of another head size
    with torch.no_grad():
        assert not ca._fp32_backward(*bf16, 0.0)
        out = ca.causal_attention(*bf16, 0.0, 0.3, True)
    assert torch.equal(out, F.scaled_dot_product_attention(*bf16, is_causal=True, scale=0.3, enable_gqa=True))
    out = ca.causal_attention(*fp32, 0.0, None, True)
    assert torch.equal(out, F.scaled_dot_product_attention(*fp32, is_causal=True, enable_gqa=True))


def test_under_bf16_autocast_with_fp32_queries_as_the_engine_gives_them():
    """The engine's bf16 autocast leaves q and k in fp32 after the rotary embedding and v in bf16; SDPA casts them
    to bf16, and so does causal_attention: the same forward bits, bf16 gradients of each input's own dtype."""
    q, k, _ = _inputs(torch.float32, seed=2)
    v = _inputs(torch.bfloat16, seed=2)[2]
    twins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ca._fp32_backward(q, k, v, 0.0)
        out = ca.causal_attention(q, k, v, 0.0, None, True)
        ref = F.scaled_dot_product_attention(*twins, is_causal=True, enable_gqa=True)
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
    out.float().sum().backward()
    ref.float().sum().backward()
    for a, b in zip((q, k, v), twins):
        assert a.grad.dtype == b.grad.dtype == a.dtype
        assert float((a.grad.float() - b.grad.float()).abs().max()) <= 5e-2 * max(float(b.grad.abs().max()), 1e-3)
