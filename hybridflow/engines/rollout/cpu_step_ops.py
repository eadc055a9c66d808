"""Small ops of the native rollout's decode step on CPU as one C call each (cpu_step_ops.c), built on first use.

Why: a decode step of a small model is mostly per-op overhead. Its rotary embedding is two gathers of the tables'
rows at the step's positions, then a product, a roll, a product and a sum per rotation (one or two per layer). An
RMSNorm is torch's five-op norm (pow, mean, add, rsqrt, two products; in bf16 with float conversions around it and
the weight's product after), 17 a step in the mid model: 9% of a 16-row fp32 generate call and 21% of the tiny
model's, in torch.profiler's self time (docs/benchmarks.md). Here each is one call that reads its tables in place.

Exactness: the rotary embedding is transformers' arithmetic bit for bit in fp32 and bf16 (the file is built without
FMA contraction, and bf16 products are rounded as torch rounds them). The fp32 norm is torch's bit for bit too: it
sums the squares in the order of torch's CPU sum kernel, whose vector width (4, 8 or 16 floats, by build and CPU) is
found at load by comparing with ``F.rms_norm``; where no width reproduces torch's bits the fp32 norm is not used
(even a last-bit difference in the norm took the rollout-vs-training log-prob mismatch past 1e-5 in
tests/engines/test_native_archs.py). The bf16 norm sums its squares in its own order, so its output can differ by
one bf16 ulp where the fp32 value sits within an fp32 ulp of a bf16 rounding boundary. The engine uses these in its
eager decode steps only (NativeDecoder.decode), never in the batch-invariant mode.

Build: on first use, for this CPU, cached per machine (c_kernels.py). Without a compiler, or when the build fails,
`load` logs why once and returns None: the decoder then keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridflow.engines.rollout.c_kernels import load_library

__all__ = ["StepOpsKernel", "load"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_step_ops.c")
_ROPE = {torch.float32: "rope_f32", torch.bfloat16: "rope_bf16"}
# at::internal::GRAIN_SIZE: torch splits one row's sum between threads from this many elements, in another order
_TORCH_GRAIN = 32768


@functools.cache
def load() -> StepOpsKernel | None:
    """The kernels, built on first use (c_kernels.py); None where they cannot be built here."""
    lib = load_library(_SOURCE, "step_ops", "rotary and RMSNorm", "the decode steps keep torch's rotary and norm ops",
                       fast_math=False, extra_flags=("-ffp-contract=off",))
    return None if lib is None else StepOpsKernel(lib)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(R, H, row stride, head stride) of x [R, n] or [R, H, n], whose last dimension is contiguous."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), x.shape[1]
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


class StepOpsKernel:
    """``rotate`` = native_model._rotate on the tables' rows at the given positions, bit for bit; ``rms_norm`` =
    native_model._rms_norm, bit for bit in fp32 (where ``f32_lanes`` was found), up to one ulp at rounding boundaries
    in bf16."""

    def __init__(self, lib: ctypes.CDLL):
        i, long, f, ptr = ctypes.c_int, ctypes.c_long, ctypes.c_float, ctypes.c_void_p
        self._rope = {}
        for dtype, name in _ROPE.items():
            function = getattr(lib, name)
            function.argtypes = [long, long, long, ptr, long, long, ptr, ptr, long, ptr, ptr, i]
            function.restype = None
            self._rope[dtype] = function
        self._rms = lib.rms_norm_bf16
        self._rms.argtypes = [long, long, long, ptr, long, long, ptr, f, i, ptr, i]  # R, H, n, x, sr, sh, w, eps,
        self._rms.restype = None  # offset, y, threads
        self._rms_f32 = lib.rms_norm_f32
        self._rms_f32.argtypes = [long, long, long, ptr, long, long, ptr, f, i, ptr, i]  # ..., eps, lanes, y, threads
        self._rms_f32.restype = i
        self._add_rms = lib.add_rms_norm_bf16
        self._add_rms.argtypes = [long, long, ptr, ptr, ptr, ptr, f, i, ptr, i]  # R, n, x, y, yw, w, eps, offset, h,
        self._add_rms.restype = None  # threads
        self._qkv_heads = lib.qkv_heads_bf16
        # R, H, KV, D, qkv, row stride, q norm, k norm, eps, offset, cos, signed sin, rotary dim, positions, q, k, v,
        # threads
        self._qkv_heads.argtypes = [long, long, long, long, ptr, long, ptr, ptr, f, i, ptr, ptr, long, ptr, ptr, ptr,
                                    ptr, i]
        self._qkv_heads.restype = None
        # addresses for the decode-layer driver that calls them from C (cpu_decode_layer.py)
        self.addresses = {name: ctypes.cast(function, ctypes.c_void_p).value for name, function in (
            ("rms_norm_f32", self._rms_f32), ("rope_f32", self._rope[torch.float32]), ("rms_norm_bf16", self._rms),
            ("add_rms_norm_bf16", self._add_rms), ("qkv_heads_bf16", self._qkv_heads))}
        self.f32_lanes = self._torch_sum_lanes()  # None: the fp32 norm is not used

    def _torch_sum_lanes(self) -> int | None:
        """The vector width with which the fp32 norm reproduces ``F.rms_norm`` bit for bit here (torch's sum kernel
        depends on its build and the CPU), tried on rows of widths around the vector sizes and up to 32,767; None
        when no width does (logged)."""
        g = torch.Generator().manual_seed(0)
        rows = [torch.randn(3, n, generator=g) * scale for n in (7, 64, 100, 512, 513, 1536, 4097, 32_767)
                for scale in (1e-3, 30.0)]
        for lanes in (8, 16, 4):  # torch's Vectorized<float> sizes (the C file takes up to 16)
            if all(torch.equal(self._norm_f32(x, torch.ones(x.shape[-1]), 1e-6, lanes),
                               F.rms_norm(x, x.shape[-1:], torch.ones(x.shape[-1]), 1e-6)) for x in rows):
                return lanes
        logger.info("native rollout: no vector width reproduces torch's fp32 RMSNorm here, so the fp32 decode keeps "
                    "torch's norm")
        return None

    @staticmethod
    def _reads(x: torch.Tensor, dtypes) -> bool:
        return (x.dtype in dtypes and x.device.type == "cpu" and x.dim() in (2, 3) and x.stride(-1) == 1
                and not torch.compiler.is_compiling())

    @staticmethod
    def reads_tables(rope) -> bool:
        """Whether `rotate` reads the rotary tables of `rope` (rope.RotaryTables) in place."""
        tables = (*rope.cos.values(), *rope.sin.values())
        return rope.rotary_dim % 2 == 0 and all(t.dtype in _ROPE and t.is_contiguous() for t in tables)

    def rotates(self, x: torch.Tensor, table: torch.Tensor) -> bool:
        """Whether `rotate` takes the heads x [R, H, D] with a table of `table`'s dtype."""
        return x.dim() == 3 and x.dtype == table.dtype and self._reads(x, _ROPE)

    def normalises(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `rms_norm` takes the rows x [R, n] or [R, H, n] with `weight`."""
        if weight.dtype == torch.float32:  # rows past torch's grain size may be summed by two threads in torch
            return self.f32_lanes is not None and x.shape[-1] < _TORCH_GRAIN and self._reads(x, (torch.float32,))
        return weight.dtype == torch.bfloat16 and self._reads(x, (torch.bfloat16,))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """x [R, H, D] (fp32 or bf16, the tables' dtype; last dimension contiguous) rotated at positions [R] with
        the tables cos, signed_sin [max_positions, rotary_dim] (rope.RotaryTables) -> [R, H, D] contiguous."""
        R, H, sr, sh = _rows(x)
        positions = positions.to(torch.int64).contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        args = (R, H, x.shape[-1], x.data_ptr(), sr, sh, cos.data_ptr(), signed_sin.data_ptr(), cos.shape[-1],
                positions.data_ptr(), out.data_ptr(), torch.get_num_threads())
        self._run(self._rope[x.dtype], "hybridflow::decode_rotary", args)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        """x [R, n] or [R, H, n] fp32 or bf16 (last dimension contiguous), weight [n] of x's dtype (Gemma: 1 + w,
        offset=True) -> the normalised rows, contiguous. In fp32 the offset makes no difference (native_model's
        _rms_norm)."""
        if x.dtype == torch.float32:
            return self._norm_f32(x, weight, eps, self.f32_lanes)
        R, H, sr, sh = _rows(x)
        weight = weight.contiguous()
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        args = (R, H, x.shape[-1], x.data_ptr(), sr, sh, weight.data_ptr(), eps, int(offset), out.data_ptr(),
                torch.get_num_threads())
        self._run(self._rms, "hybridflow::decode_rms_norm", args)
        return out

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, y_weight: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, offset: bool) -> torch.Tensor:
        """A bf16 decode step's residual and the norm after it: x += y (y normalised with `y_weight` first, where
        given: Gemma's sandwich norm), in place, and returns rms_norm(x, weight). x, y [R, n] bf16 contiguous on CPU;
        the bits of torch's bf16 add and of `rms_norm`."""
        R, n = x.shape
        if not (x.dtype == y.dtype == weight.dtype == torch.bfloat16 and x.is_contiguous() and y.is_contiguous()
                and y.shape == x.shape and (y_weight is None or y_weight.dtype == torch.bfloat16)):
            raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and y {tuple(y.shape)} {y.dtype} must be "
                             "contiguous bf16 rows of one shape, the weights bf16")
        weight = weight.contiguous()
        y_weight = None if y_weight is None else y_weight.contiguous()
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        args = (R, n, x.data_ptr(), y.data_ptr(), None if y_weight is None else y_weight.data_ptr(),
                weight.data_ptr(), eps, int(offset), out.data_ptr(), torch.get_num_threads())
        self._run(self._add_rms, "hybridflow::add_rms_norm", args)
        return out

    def qkv_heads(self, qkv: torch.Tensor, heads: int, kv_heads: int, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, eps: float, offset: bool, cos: torch.Tensor, signed_sin: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A bf16 decode step's q [R, heads, D], k, v [R, kv_heads, D] (contiguous) from its fused projection qkv
        [R, (heads + 2 kv_heads) D] (last dimension contiguous): q and k normalised per head (where q_norm / k_norm
        are given) and rotated at positions [R] with the tables cos, signed_sin [max_positions, rotary_dim], as
        `rms_norm` and `rotate` compute them, bit for bit; v copied."""
        R, width = qkv.shape
        D = width // (heads + 2 * kv_heads)
        if not (qkv.dtype == cos.dtype == signed_sin.dtype == torch.bfloat16 and qkv.stride(-1) == 1
                and D * (heads + 2 * kv_heads) == width and cos.is_contiguous() and signed_sin.is_contiguous()):
            raise ValueError(f"qkv_heads: qkv {tuple(qkv.shape)} {qkv.dtype} must be bf16 rows of {heads} + 2 x "
                             f"{kv_heads} heads with bf16 tables, its last dimension contiguous")
        q_norm, k_norm = (None if w is None else w.contiguous() for w in (q_norm, k_norm))
        positions = positions.to(torch.int64).contiguous()
        q, k, v = (torch.empty(R, n, D, dtype=torch.bfloat16) for n in (heads, kv_heads, kv_heads))
        args = (R, heads, kv_heads, D, qkv.data_ptr(), qkv.stride(0),
                None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(),
                eps, int(offset), cos.data_ptr(), signed_sin.data_ptr(), cos.shape[-1], positions.data_ptr(),
                q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.get_num_threads())
        self._run(self._qkv_heads, "hybridflow::qkv_heads", args)
        return q, k, v

    def _norm_f32(self, x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int) -> torch.Tensor:
        R, H, sr, sh = _rows(x)
        weight = weight.contiguous()
        out = torch.empty(x.shape, dtype=torch.float32)
        args = (R, H, x.shape[-1], x.data_ptr(), sr, sh, weight.data_ptr(), eps, lanes, out.data_ptr(),
                torch.get_num_threads())
        self._run(self._rms_f32, "hybridflow::decode_rms_norm", args)
        return out

    @staticmethod
    def _run(function, name: str, args: tuple) -> None:
        if torch.autograd._profiler_enabled():  # a named range in torch.profiler's tables (no op of its own)
            with torch.profiler.record_function(name):
                function(*args)
        else:
            function(*args)
