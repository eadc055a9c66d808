"""Entropy from logits: plain and chunked agree with -sum p log p, in value and gradient."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import entropy_from_logits, entropy_from_logits_chunked


def ref_entropy(row: list[float]) -> float:
    """Shannon entropy in nats of softmax(row), with the max subtracted for stability."""
    top = max(row)
    exps = [math.exp(z - top) for z in row]
    total = sum(exps)
    return -sum(e / total * math.log(e / total) for e in exps)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_entropy_matches_reference_and_chunked_matches_plain(chunk_size):
    gen = torch.Generator().manual_seed(chunk_size)
    logits = torch.randn(13, 11, generator=gen, dtype=torch.float64) * 3
    logits[0] = 0.0  # uniform: entropy ln V
    logits[1, 0] = 60.0  # nearly one-hot: entropy ~ 0
    expected = torch.tensor([ref_entropy(r) for r in logits.tolist()], dtype=torch.float64)
    torch.testing.assert_close(entropy_from_logits(logits), expected, atol=1e-9, rtol=0)
    torch.testing.assert_close(entropy_from_logits_chunked(logits, chunk_size=chunk_size), expected, atol=1e-9, rtol=0)
    assert expected[0].item() == pytest.approx(math.log(11))


def test_chunked_gradient_is_exact():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 5, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits_chunked(z, chunk_size=4), (logits,))
    weights = torch.randn(6, generator=gen, dtype=torch.float64)
    (g_plain,) = torch.autograd.grad((entropy_from_logits(logits) * weights).sum(), logits)
    (g_chunk,) = torch.autograd.grad((entropy_from_logits_chunked(logits, 4) * weights).sum(), logits)
    torch.testing.assert_close(g_chunk, g_plain, atol=1e-9, rtol=0)


def test_shapes_and_half_precision():
    logits = torch.randn(2, 3, 17, dtype=torch.bfloat16)
    plain = entropy_from_logits(logits)
    chunked = entropy_from_logits_chunked(logits, chunk_size=4)
    assert plain.shape == chunked.shape == (2, 3)
    assert plain.dtype == chunked.dtype == torch.float32  # computed in float32, not bfloat16
    torch.testing.assert_close(chunked, plain)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits_chunked(logits, chunk_size=0)
