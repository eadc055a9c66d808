"""The native rollout's fp32 projections on CPU as one C kernel (cpu_panel_linear.c), built on first use.

Why: a decode step multiplies a few dozen rows by every weight matrix, so it streams all the weights from memory once
per step and does little arithmetic per weight; at 16 rows of the ~21M "mid" model the step's weight bytes and its
FLOPs take about the same time at this machine's bandwidth and matmul peak, and oneDNN's packed matmul
(onednn_linear.py) took about twice the larger of the two. The kernel packs each weight [N, K] once into panels of 16
output columns ([ceil(N / 16), K, 16], zero past N), and per task of 32 columns (16 with AVX2) keeps every
(row, column) sum of a block of up to 12 rows (6 with AVX2) in registers over the whole K loop: one load of the
weights per k, one broadcast and one FMA per row. A call of two blocks (13-23 rows, 16 being a GRPO decode step's)
runs both per chunk of 64 k, so the second reads the weights from L1 (docs/benchmarks-history.md, eighteenth
session). The AVX-512 build beat the oneDNN-packed product at every row count
from 1 to 64 on the mid model's shapes, most at few rows (docs/benchmarks-history.md, "A panel kernel for the decode's
projections").

Exactness: fp32 products with fp32 FMA accumulation over k in order, bias added last; results differ from
``F.linear`` by rounding only, and a row's result never depends on how many rows are in the call, up to MAX_ROWS
rows: a larger call (a prefill's) runs ``F.linear`` on the fp32 weight itself. It needs AVX-512F,
or AVX2 with FMA; on other CPUs, without a compiler, or when the
build fails, `load` returns None (logged once) and the decoder keeps oneDNN's packed weights. The training engine's
forward is oneDNN's, so the batch-invariant mode (bitwise equal log-probs) keeps oneDNN in the rollout too.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridflow.engines.rollout.c_kernels import load_library

__all__ = ["MAX_ROWS", "MIN_PANEL_WIDTH", "PANEL", "PanelLinearKernel", "PanelWeight", "kernel_for", "load"]

_SOURCE = Path(__file__).with_name("cpu_panel_linear.c")
PANEL = 16  # output columns per panel (the C file's PANEL)
# The decoder packs for this kernel from this hidden size up (prepack=None): at hidden 64 the call's fixed cost
# (~8 us) made it slower than F.linear, at 128 it was faster at 16-512 rows with 2 threads (docs/benchmarks.md)
MIN_PANEL_WIDTH = 128
# Calls of more rows (a prefill's) run as F.linear on the fp32 weight itself: from about 512 rows its blocked product
# overtook the panel kernel, which keeps a row's sums in registers over the whole k loop (docs/benchmarks-history.md,
# thirty-fourth session)
MAX_ROWS = 512


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> PanelLinearKernel | None:
    """The kernel, built on first use (c_kernels.py); None where it cannot run here. `extra_flags`: added compiler
    flags (``("-mno-avx512f",)`` builds the AVX2 variant)."""
    if not (_cpu_has("_is_avx512_supported") or _cpu_has("_is_avx2_supported")):
        return None
    lib = load_library(_SOURCE, "panel_linear", "projection", "the projections run as oneDNN's packed matmuls",
                       fast_math=False, extra_flags=extra_flags)
    return None if lib is None else PanelLinearKernel(lib)


def _cpu_has(probe: str) -> bool:
    """torch.cpu's private ISA probe `probe`; a torch without it says nothing, so the build decides (the C file
    refuses to compile without AVX2 and FMA, and `load` then returns None)."""
    return bool(getattr(torch.cpu, probe, lambda: True)())


def kernel_for(setting: bool | None) -> PanelLinearKernel | None:
    """The kernel a decoder uses for `setting` (its ``linear_kernel``): False -> None; True or None (default) -> the
    kernel built here, the AVX-512 or the AVX2 build. (Until the AVX2 build kept its sums in registers it ran at half
    the FMA rate and AVX2-only CPUs kept oneDNN by default; on an AVX2-only AMD EPYC it now beats oneDNN's packed
    product at 8-64 rows: docs/benchmarks-history.md, twenty-third session.)"""
    return None if setting is False else load()


class PanelWeight:
    """A weight [N, K] packed into panels: ``panels`` [ceil(N / 16), K, 16] fp32, ``out_features`` = N; ``weight``
    the fp32 weight itself where it was packed from one (the caller's tensor, not a copy), for calls of more than
    MAX_ROWS rows."""

    __slots__ = ("out_features", "panels", "weight")

    def __init__(self, panels: torch.Tensor, out_features: int, weight: torch.Tensor | None = None):
        self.panels, self.out_features, self.weight = panels, out_features, weight


class PanelLinearKernel:
    """``pack`` a weight once; ``linear(x, packed, bias)`` = F.linear(x, weight, bias) in fp32 on CPU."""

    def __init__(self, lib: ctypes.CDLL):
        ptr, long = ctypes.c_void_p, ctypes.c_long
        self._function = lib.panel_linear_f32
        self._function.argtypes = [ptr, long, long, ptr, long, ptr, ptr]  # x, M, K, packed, N, bias, y
        self._function.restype = None
        # its address, for the decode-layer driver that calls it from C (cpu_decode_layer.py)
        self.address = ctypes.cast(self._function, ctypes.c_void_p).value
        self.vector_width = int(lib.panel_linear_vector_width())  # floats per register: 16 (AVX-512) or 8 (AVX2)

    @staticmethod
    @torch.no_grad()
    def pack(weight: torch.Tensor, out: PanelWeight | None = None) -> PanelWeight:
        """A CPU weight [N, K] (any float dtype; computed in fp32) -> its panels; written into `out` (returned) when
        it holds panels of this shape: a re-pack after a weight update then reuses their memory, where a new tensor
        of the whole model's size would first fault in its pages (about twice the time of the copy alone)."""
        source = weight.detach() if weight.dtype == torch.float32 else None  # kept only where it is no copy
        weight = weight.detach().float()
        n, k = weight.shape
        shape = PanelLinearKernel.panel_shape(n, k)
        if out is not None and out.out_features == n and tuple(out.panels.shape) == shape:
            # the columns past N of the last panel keep their zeros (from panel_weights or an earlier pack)
            out.panels[: n // PANEL].copy_(weight[: n // PANEL * PANEL].reshape(n // PANEL, PANEL, k).transpose(1, 2))
            if n % PANEL:
                out.panels[-1, :, : n % PANEL].copy_(weight[n // PANEL * PANEL :].transpose(0, 1))
            out.weight = source
            return out
        if shape[0] * PANEL != n:
            weight = torch.cat([weight, weight.new_zeros(shape[0] * PANEL - n, k)])
        return PanelWeight(weight.reshape(shape[0], PANEL, k).transpose(1, 2).contiguous(), n, source)

    @staticmethod
    def panel_shape(n: int, k: int) -> tuple[int, int, int]:
        """The packed shape of a weight [n, k]: [ceil(n / 16), k, 16]."""
        return (-(-n // PANEL), k, PANEL)

    @staticmethod
    def panel_weights(shapes: list[tuple[int, int]], buffer: torch.Tensor | None = None) -> list[PanelWeight]:
        """Zeroed panels for weights of `shapes` [(n, k)], one after another in `buffer` (uint8, at least
        ``panel_bytes(shapes)``; default: a new tensor), each starting on a 64-byte line; pack(weight, out=...) fills
        them."""
        need = PanelLinearKernel.panel_bytes(shapes)
        buffer = torch.zeros(need, dtype=torch.uint8) if buffer is None else buffer[:need].zero_()
        out, offset = [], 0
        for n, k in shapes:
            shape = PanelLinearKernel.panel_shape(n, k)
            count = shape[0] * k * PANEL
            out.append(PanelWeight(buffer[offset : offset + 4 * count].view(torch.float32).view(shape), n))
            offset += -(-4 * count // 64) * 64
        return out

    @staticmethod
    def panel_bytes(shapes: list[tuple[int, int]]) -> int:
        """The bytes panel_weights takes for weights of `shapes` [(n, k)]."""
        return sum(-(-4 * PanelLinearKernel.panel_shape(n, k)[0] * k * PANEL // 64) * 64 for n, k in shapes)

    def linear(self, x: torch.Tensor, packed: PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] fp32 -> [..., N]."""
        k = x.shape[-1]
        if x.dtype != torch.float32 or packed.panels.shape[1] != k:
            raise ValueError(f"panel linear: x {tuple(x.shape)} {x.dtype} against a packed weight of "
                             f"{packed.out_features} x {packed.panels.shape[1]} fp32")
        rows = x.reshape(-1, k)
        if rows.shape[0] > MAX_ROWS and packed.weight is not None:
            return F.linear(x, packed.weight, bias)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        n = packed.out_features
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        if rows.shape[0]:
            args = (rows.data_ptr(), rows.shape[0], k, packed.panels.data_ptr(), n,
                    None if bias is None else bias.data_ptr(), out.data_ptr())
            if torch.autograd._profiler_enabled():  # a named range in torch.profiler's tables (no op of its own)
                with torch.profiler.record_function("hybridflow::panel_linear"):
                    self._function(*args)
            else:
                self._function(*args)
        return out.view(*x.shape[:-1], n)
