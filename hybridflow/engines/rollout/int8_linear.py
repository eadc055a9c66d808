"""int8 weights for the native rollout's matmuls on CPU: per-output-channel symmetric int8 weights, activations
quantized per call (dynamic quantization), int32 accumulation, fp32 out.

Why: on a CPU without AVX512-BF16/AMX, bf16 matmuls are emulated (7x slower than fp32, measured), so int8 is the
low-precision path that pays off there. In a decode loop at batch 64 it ran 2.5x faster than fp32 (the weights are a
quarter of the bytes to stream every step). The price is precision: each matmul is off by ~1% relative, so the
rollout's log-probs drift from the fp32 actor's; the trainer reports that drift as ``rollout/mismatch_*``.

The kernels are fbgemm's (``torch.ops.quantized.linear_dynamic``). Building their packed weights goes through torch's
qint8 tensor type, which torch has deprecated; the warning is silenced here and a torch without the ops gets a clear
error at engine construction instead of a failure mid-run.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["check_int8_supported", "int8_linear", "pack_int8"]

# fbgemm's AVX2 kernels add pairs of u8*s8 products in int16; 7-bit activations keep those sums from saturating.
_REDUCE_RANGE = True


def check_int8_supported(device: torch.device) -> None:
    """Raise a ValueError saying what to use instead when int8 rollout weights cannot run here."""
    if device.type != "cpu":
        raise ValueError(
            f"rollout dtype 'int8' runs on CPU only (this worker computes on {device.type}); use dtype='bf16' on GPUs"
        )
    if not hasattr(torch.ops.quantized, "linear_dynamic"):
        raise ValueError(
            f"rollout dtype 'int8' needs torch's fbgemm quantized ops, which torch {torch.__version__} lacks; "
            "use dtype='fp32'"
        )
    try:
        pack_int8(torch.ones(8, 8), None)
    except RuntimeError as err:
        raise ValueError(
            f"rollout dtype 'int8': this torch build cannot pack int8 weights ({err}); use dtype='fp32'"
        ) from err


@torch.no_grad()
def pack_int8(weight: torch.Tensor, bias: torch.Tensor | None):
    """fp32 weight [out, in] (+ bias [out]) -> fbgemm's packed int8 weight, one scale per output row."""
    weight = weight.detach().float().contiguous()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
        warnings.filterwarnings("ignore", message=".*quantize_per_channel.*deprecated")
        q_weight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q_weight, None if bias is None else bias.detach().float())


def int8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x [..., in] fp32 -> [..., out] fp32, like F.linear with the packed weight and bias."""
    return torch.ops.quantized.linear_dynamic(x, packed, _REDUCE_RANGE)
