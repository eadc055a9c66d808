"""fp32 weights pre-packed for oneDNN, for the native rollout's matmuls on CPU.

Why: a decode step multiplies a few dozen rows by every weight matrix, and at that shape how the weight is laid out
in memory matters more than the arithmetic. With the weights reordered once into oneDNN's blocked layout (the packing
torch's own inductor uses for frozen CPU linears) the layer matmuls of a 64-row decode step of the ~21M "mid" model
took 28 ms instead of 46 ms with ``F.linear`` (2 threads, AVX2; benchmarks/rollout_throughput.py reports the
end-to-end effect). It is still fp32 arithmetic: results differ from ``F.linear`` by rounding only (~2e-6 absolute
on unit-scale outputs), and each row's result does not depend on how many other rows are in the batch.

The ops are torch's ``mkldnn::_reorder_linear_weight`` / ``mkldnn::_linear_pointwise``. A torch without them, or
whose packed product disagrees with ``F.linear``, is detected once (``onednn_available``) and the decoder falls back
to ``F.linear``. Packed weights are copies: they are rebuilt after every weight update (native_model.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["MIN_PACKED_WIDTH", "onednn_available", "onednn_linear", "pack_onednn"]

# Rows the packed layout is tuned for; any row count works (measured faster than F.linear at 16, 64 and 256 rows).
_ROWS_HINT = 64
# Below this hidden size packing does not pay: for [3h, h] weights at 64 rows (2 threads) packed/F.linear time was
# 1.26 at h=128 (slower), 0.53 at h=256, 0.64 at h=384, 0.78 at h=512, 0.70 at h=768.
MIN_PACKED_WIDTH = 256


@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    """True when this torch can pack fp32 weights for oneDNN and the packed product matches F.linear."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, b, x = torch.randn(24, 16, generator=g), torch.randn(24, generator=g), torch.randn(5, 16, generator=g)
        got = onednn_linear(x, pack_onednn(w), b)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5))


@torch.no_grad()
def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """fp32 CPU weight [out, in] -> the same matrix in oneDNN's packed layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), _ROWS_HINT)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] fp32 -> [..., out] fp32, F.linear(x, weight, bias) with the packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
