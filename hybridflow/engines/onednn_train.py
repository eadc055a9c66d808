"""The training engine's fp32 projections on CPU through oneDNN, forward and backward.

Why: torch's CPU wheel multiplies fp32 matrices with MKL (``F.linear``, ``torch.mm``), and on processors other than
Intel's MKL takes a slow code path (AMD EPYC: about half of what oneDNN, also inside torch, reaches on the same cores;
docs/benchmarks-history.md, "The matmul peak"). On Intel's it is the faster of the two (an Intel Xeon with AVX-512:
MKL 8-14% ahead of oneDNN at the mid model's training shapes; docs/benchmarks-history.md, nineteenth session). An
`OneDNNLinear` computes the same three products of a linear layer with oneDNN instead:

    forward       y      = x W^T + b      mkldnn::_linear_pointwise(x, W, b)
    backward      dL/dx  = g W            mkldnn::_linear_pointwise(g, W^T)       (W^T passed as a view)
                  dL/dW  = g^T x          torch.mm(g^T, x)                        (views of the flattened rows)
                  dL/db  = sum of g over rows

dL/dW contracts over the rows, so both of its operands are transposed views. oneDNN's inner product copies such a
view into a contiguous layout first (torch's transpose copy, on one thread: about 7% of a mid training step); the BLAS
``mm`` reads them in place, and its weight gradient was 3-4% faster per training step (docs/benchmarks-history.md, ninth
session).

It is fp32 arithmetic with fp32 accumulation, as MKL's: results differ from ``F.linear`` by rounding only. Anything
else (bf16 weights or inputs, autocast, a DTensor weight, another device) takes ``nn.Linear``'s own forward.

The engine turns its model's ``nn.Linear`` layers into `OneDNNLinear` in place (`use_onednn_linears`; same
parameters and state dict, so checkpoints, FSDP2 sharding, PEFT adapters and export are unchanged) when
`onednn_training` says oneDNN runs here: `EngineConfig.onednn_linears` (None: on CPU in fp32 where torch has
oneDNN, from hidden size MIN_HIDDEN_SIZE up, unless MKL is on its own fast path: `mkl_fast_path`). The choice depends
on the processor only, never on a timing, so a run and its resumption on one machine compute the same bits. The
batch-invariant mode relies on the same forward, which is the native rollout's kernel (batch_invariant.py).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.common.machine import cpu_vendor
from hybridflow.engines.rollout.onednn_linear import onednn_available, onednn_linear

__all__ = ["MIN_HIDDEN_SIZE", "OneDNNLinear", "mkl_fast_path", "onednn_training", "use_onednn_linears"]


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [..., k] @ b[n, k]^T (+ bias [n]) -> [..., n] by oneDNN; b may be a plain or strided tensor."""
    return onednn_linear(a, b, bias)


class _OneDNNLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = _product(grad, weight.t()) if need_x else None
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = torch.mm(flat.t(), x.reshape(-1, x.shape[-1])) if need_w else None
        grad_b = flat.sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b


def _plain_fp32_cpu(t: torch.Tensor) -> bool:
    # a DTensor (tensor parallelism) or a tensor subclass goes through nn.Linear's dispatch
    return t.dtype == torch.float32 and t.device.type == "cpu" and type(t.data) is torch.Tensor


class OneDNNLinear(nn.Linear):
    """An nn.Linear whose fp32 CPU products (forward and backward) are oneDNN's; any other case is nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_autocast_enabled(x.device.type) or not _plain_fp32_cpu(x) or not _plain_fp32_cpu(self.weight)
                or (self.bias is not None and not _plain_fp32_cpu(self.bias))):
            return super().forward(x)
        return _OneDNNLinearFn.apply(x, self.weight, self.bias)


# Below this hidden size the autograd function's per-call cost outweighs the faster kernel (docs/benchmarks-history.md,
# "The matmul peak, and oneDNN in the training engine"); the rollout packs its weights from the same width up.
MIN_HIDDEN_SIZE = 256


def mkl_fast_path() -> bool:
    """True when torch's fp32 matmuls are MKL's on an Intel processor, where MKL takes its own fast code path (module
    docstring): there the engine keeps torch's matmuls."""
    return torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"


def onednn_training(device: torch.device, compute_dtype: torch.dtype, setting: bool | None = None,
                    hidden_size: int | None = None) -> bool:
    """Whether the training engine's linears run on oneDNN: `setting` when given (True where it cannot run is an
    error), else on CPU in fp32 where torch's oneDNN passes onednn_available's check and MKL is not on its fast path
    (`mkl_fast_path`), for models of hidden size MIN_HIDDEN_SIZE and up (None: any)."""
    possible = torch.device(device).type == "cpu" and onednn_available(torch.float32)
    if setting is None:
        wide = hidden_size is None or hidden_size >= MIN_HIDDEN_SIZE
        return possible and compute_dtype == torch.float32 and wide and not mkl_fast_path()
    if setting and not possible:
        raise ValueError(f"onednn_linears=True needs a CPU whose torch has oneDNN (device {device}); leave it unset "
                         "(None) to choose by device")
    return bool(setting)


def use_onednn_linears(model: nn.Module) -> int:
    """Turn every plain nn.Linear of `model` into an OneDNNLinear in place (same parameters, same state dict);
    returns how many. Run it on the finished module tree: after PEFT has injected its layers, before FSDP shards."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            count += 1
    return count
