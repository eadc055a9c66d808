"""fp32 and bf16 weights pre-packed for oneDNN, for the native rollout's matmuls on CPU.

Why: a decode step multiplies a few dozen rows by every weight matrix, and at that shape how the weight is laid out
in memory matters more than the arithmetic. With the weights reordered once into oneDNN's blocked layout (the packing
torch's own inductor uses for frozen CPU linears) the layer matmuls of a 64-row decode step of the ~21M "mid" model
took 28 ms instead of 46 ms with ``F.linear`` (2 threads, AVX2; benchmarks/rollout_throughput.py reports the
end-to-end effect). In fp32 it is still fp32 arithmetic: results differ from ``F.linear`` by rounding only (~2e-6
absolute on unit-scale outputs). In bf16 the packed product is the one ``F.linear`` computes (both are oneDNN's bf16
matmul with fp32 accumulation; ``onednn_available`` checks bitwise equality), so bf16 greedy decoding still follows
transformers'. Either way each row's result does not depend on how many other rows are in the batch.

bf16 is packed only where the CPU computes bf16 in hardware (AVX512-BF16 or AMX, ``native_bf16``): elsewhere
oneDNN emulates it and the decoder keeps ``F.linear`` (layout.warn_if_slow_bf16 says to use fp32 there).

The ops are torch's ``mkldnn::_reorder_linear_weight`` / ``mkldnn::_linear_pointwise``. A torch without them, or
whose packed product disagrees with ``F.linear``, is detected once per dtype (``onednn_available``) and the decoder
falls back to ``F.linear``. Packed weights are copies: they are rebuilt after every weight update (native_model.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["MIN_PACKED_WIDTH", "PACKED_DTYPES", "native_bf16", "onednn_available", "onednn_linear", "pack_onednn"]

# Rows the packed layout is tuned for; any row count works (measured faster than F.linear at 16, 64 and 256 rows).
_ROWS_HINT = 64
# Below this hidden size packing does not pay: for [3h, h] weights at 64 rows (2 threads) packed/F.linear time was
# 1.26 at h=128 (slower), 0.53 at h=256, 0.64 at h=384, 0.78 at h=512, 0.70 at h=768.
MIN_PACKED_WIDTH = 256
PACKED_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """True when this CPU has bf16 arithmetic units (AVX512-BF16 or AMX), so oneDNN's bf16 kernels are not emulated."""
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch can pack `dtype` weights for oneDNN and the packed product matches F.linear:
    to fp32 rounding in fp32; bitwise in bf16, and only on a CPU with native bf16."""
    if dtype not in PACKED_DTYPES or (dtype == torch.bfloat16 and not native_bf16()):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, b, x = (torch.randn(*size, generator=g).to(dtype) for size in ((48, 32), (48,), (5, 32)))
        got = onednn_linear(x, pack_onednn(w), b)
    except (RuntimeError, NotImplementedError):
        return False
    want = F.linear(x, w, b)
    if dtype == torch.bfloat16:
        return torch.equal(got, want)
    return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))


@torch.no_grad()
def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """CPU weight [out, in] (fp32 or bf16; other dtypes become fp32) -> the same matrix in oneDNN's packed layout
    (an opaque tensor of the same dtype)."""
    weight = weight.detach()
    if weight.dtype not in PACKED_DTYPES:
        weight = weight.float()
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ROWS_HINT)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype (the packed weight's), F.linear(x, weight, bias) with the packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
