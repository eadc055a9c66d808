"""The native rollout's per-step rotary embedding on CPU as one C call (cpu_rotary.c), built on first use.

Why: a decode step of a small model is mostly per-op overhead, and its rotary embedding is two gathers of the
tables' rows at the step's positions, then a product, a roll, a product and a sum per rotation (one or two per
layer). Here each rotation is one call that reads the tables in place.

Exactness: transformers' arithmetic bit for bit (the file is built without FMA contraction), so the engine could use
it anywhere; it runs in the eager decode steps (NativeDecoder.decode), where the per-op cost is the step's. An RMSNorm
kernel was tried beside it and dropped: its sum of squares rounds differently from torch's reduction, and that alone
took the rollout-vs-training log-prob mismatch past 1e-5 (two architectures of tests/engines/test_native_archs.py).

Build: on first use, for this CPU, cached per machine (c_kernels.py). Without a compiler, or when the build fails,
`load` logs why once and returns None: the decoder then keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from hybridflow.engines.rollout.c_kernels import load_library

__all__ = ["RotaryKernel", "load"]

_SOURCE = Path(__file__).with_name("cpu_rotary.c")


@functools.cache
def load() -> RotaryKernel | None:
    """The kernel, built on first use (c_kernels.py); None where it cannot be built here."""
    lib = load_library(_SOURCE, "rotary", "rotary-embedding", "the decode steps keep torch's rotary ops",
                       fast_math=False, extra_flags=("-ffp-contract=off",))
    return None if lib is None else RotaryKernel(lib)


class RotaryKernel:
    """``rotate`` = native_model._rotate on the tables' rows at the given positions, bit for bit."""

    def __init__(self, lib: ctypes.CDLL):
        i, long, ptr = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
        self._rope = lib.rope_f32
        self._rope.argtypes = [long, long, long, ptr, long, long, ptr, ptr, long, ptr, ptr, i]
        self._rope.restype = None

    @staticmethod
    def reads_tables(rope) -> bool:
        """Whether `rotate` reads the rotary tables of `rope` (rope.RotaryTables) in place."""
        tables = (*rope.cos.values(), *rope.sin.values())
        return rope.rotary_dim % 2 == 0 and all(t.dtype == torch.float32 and t.is_contiguous() for t in tables)

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Whether x (the heads to rotate) is in a layout and dtype the kernel reads."""
        return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3 and x.stride(-1) == 1
                and not torch.compiler.is_compiling())

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """x [R, H, D] fp32 (last dimension contiguous) rotated at positions [R] with the tables cos, signed_sin
        [max_positions, rotary_dim] (rope.RotaryTables) -> [R, H, D] contiguous."""
        R, H, D = x.shape
        positions = positions.to(torch.int64).contiguous()
        out = torch.empty(x.shape, dtype=torch.float32)
        args = (R, H, D, x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), signed_sin.data_ptr(),
                cos.shape[-1], positions.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if torch.autograd._profiler_enabled():  # a named range in torch.profiler's tables (no op of its own)
            with torch.profiler.record_function("hybridflow::rotary"):
                self._rope(*args)
        else:
            self._rope(*args)
        return out
