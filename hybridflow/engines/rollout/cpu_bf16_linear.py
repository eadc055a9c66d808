"""The native rollout's bf16 projections on packed tiles (cpu_bf16_linear.c), built on first use where the CPU has bf16
units: AMX's tile product where it has AMX, AVX512-BF16's dot products elsewhere (AMD Zen 4 and later).

Why: a decode step multiplies a few dozen rows by every weight matrix, so its time is the weights' trip from memory.
oneDNN's packed bf16 product (onednn_linear.py), the bf16 decoder's default until then, streamed a decode step's weights
at about 18-25 GB/s on an AMX host, where the same memory gives a plain read twice that (docs/benchmarks-history.md,
thirty-third session); on an AVX512-BF16 host without AMX the dot products here took less time than it up to 64 rows
(thirty-ninth session). The kernel packs each weight once into ``[ceil(N / 16), ceil(K / 32), 16, 32]`` bf16 tiles: what
AMX's tile product reads, and rows of VDPBF16PS's operand as they are, so a call reads them once, in order. With the
projections in this one layout a bf16 decode step runs as one C call (cpu_bf16_step.py) on either kind.

Exactness: bf16 products summed in fp32, k in order, bias added in fp32, one rounding to bf16: the arithmetic of
oneDNN's product, with which AMX's agreed bit for bit at 16 and 32 rows in the thirty-third session's check and on
all but a few elements in 10^5 at 64 rows (oneDNN then orders its sums differently), and the dot products bit for bit
on every shape checked in the thirty-ninth; each row's result does not depend on the other rows of the call.
`load` checks the kernel against ``F.linear`` before the decoder uses it.

AMX runs where torch reports its tiles and Linux grants the process their state (arch_prctl), with a compiler that
knows AMX (GCC 11 or later); the dot products where torch reports AVX512-BF16. Elsewhere `load` returns None and the
bf16 decoder keeps oneDNN's packed weights.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridflow.engines.rollout.c_kernels import load_library

__all__ = ["KINDS", "Bf16LinearKernel", "Bf16Weight", "available_kinds", "built_kinds", "load"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_bf16_linear.c")
ROWS, KSTEP = 16, 32  # the tiles' rows, and bf16 k per tile row (the C file's ROWS and KSTEP)
# Calls of more rows (a prefill's) run as F.linear on the weight itself: the AMX kernel keeps every weight tile for all
# of a call's rows only up to 64 of them, and from about 256 rows oneDNN's product of the plain weight was faster
# (docs/benchmarks-history.md, thirty-third session)
MAX_ROWS = 256
KINDS = ("amx", "avx512_bf16")  # in order of preference
_PRODUCTS = {"amx": "amx_linear_bf16", "avx512_bf16": "dot_linear_bf16"}  # each kind's C function
_FALLBACK = "the bf16 projections run as oneDNN's packed matmuls"


def _cpu_has(kind: str) -> bool:
    probe = {"amx": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}[kind]
    return bool(getattr(torch.cpu, probe, lambda: False)())


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not any(_cpu_has(kind) for kind in KINDS):
        return None
    return load_library(_SOURCE, "bf16_linear", "bf16 projection", _FALLBACK, fast_math=False)


@functools.cache
def load(kind: str | None = None) -> Bf16LinearKernel | None:
    """The kernel of `kind` (one of KINDS; None: the first that runs here), built on first use (c_kernels.py) and
    checked against F.linear; None where it cannot run here."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown bf16 projection kernel {kind!r}; choose one of {KINDS}")
    if kind is None:
        return next((kernel for kernel in map(load, KINDS) if kernel is not None), None)
    lib = _built(kind)
    if lib is None:
        return None
    if kind == "amx" and lib.amx_request() != 0:
        logger.info("native rollout: Linux did not grant this process AMX's tile state, so %s",
                    "the bf16 projections run as AVX512-BF16 products" if load("avx512_bf16") else _FALLBACK)
        return None
    kernel = Bf16LinearKernel(lib, kind)
    return kernel if kernel.agrees_with_torch() else None


def available_kinds() -> list[str]:
    """The kinds of KINDS whose kernel runs here."""
    return [kind for kind in KINDS if load(kind) is not None]


def _built(kind: str) -> ctypes.CDLL | None:
    """The library where this CPU has `kind` and the compiler built its product, else None."""
    lib = _library() if _cpu_has(kind) else None
    return lib if lib is not None and hasattr(lib, _PRODUCTS[kind]) else None


def built_kinds() -> list[str]:
    """The kinds of KINDS that this CPU has, the compiler built and Linux lets this process use (AMX's tile state):
    each should pass its check against F.linear, so that available_kinds() is the same list (tests run each)."""
    return [kind for kind in KINDS
            if (lib := _built(kind)) is not None and (kind != "amx" or lib.amx_request() == 0)]


class Bf16Weight:
    """A weight [N, K] packed into tiles: ``tiles`` [ceil(N / 16) * ceil(K / 32) * 512] bf16; ``weight`` is the
    bf16 weight itself (the caller's tensor, not a copy), for calls of more than MAX_ROWS rows."""

    __slots__ = ("tiles", "weight")

    def __init__(self, tiles: torch.Tensor, weight: torch.Tensor):
        self.tiles, self.weight = tiles, weight

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


class Bf16LinearKernel:
    """``pack`` a bf16 weight once; ``linear(x, packed, bias)`` = F.linear(x, weight, bias) in bf16 on CPU, by AMX
    tiles or AVX512-BF16 dot products (`kind`)."""

    def __init__(self, lib: ctypes.CDLL, kind: str):
        ptr, long = ctypes.c_void_p, ctypes.c_long
        self.kind = kind
        self._pack = lib.bf16_pack
        self._pack.argtypes = [ptr, long, long, long, ptr, ctypes.c_int]  # w, N, K, row stride, packed, threads
        self._pack.restype = None
        self._linear = getattr(lib, _PRODUCTS[kind])
        # x, M, K, packed, N, bias, y, threads
        self._linear.argtypes = [ptr, long, long, ptr, long, ptr, ptr, ctypes.c_int]
        self._linear.restype = None
        # for C callers that run several projections in one call (cpu_bf16_step.py's routed experts)
        self.linear_address = ctypes.cast(self._linear, ctypes.c_void_p).value

    @staticmethod
    def tile_count(n: int, k: int) -> int:
        """bf16 elements of a packed weight [n, k]."""
        return -(-n // 16) * -(-k // KSTEP) * ROWS * KSTEP

    @torch.no_grad()
    def pack(self, weight: torch.Tensor, out: Bf16Weight | None = None) -> Bf16Weight:
        """A CPU weight [N, K] (rounded to bf16) -> its tiles; written into `out` (returned) when it holds tiles of
        this shape (a re-pack after a weight update reuses their memory)."""
        weight = weight.detach().to(torch.bfloat16)
        n, k = weight.shape
        count = self.tile_count(n, k)
        if out is None or out.tiles.numel() != count:
            out = Bf16Weight(torch.empty(count, dtype=torch.bfloat16), weight)
        out.weight = weight
        rows = weight if weight.stride(-1) == 1 else weight.contiguous()
        self._pack(rows.data_ptr(), n, k, rows.stride(0), out.tiles.data_ptr(), torch.get_num_threads())
        return out

    def linear(self, x: torch.Tensor, packed: Bf16Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] bf16 -> [..., N] bf16."""
        k, n = packed.in_features, packed.out_features
        if x.dtype != torch.bfloat16 or x.shape[-1] != k:
            raise ValueError(f"bf16 {self.kind} linear: x {tuple(x.shape)} {x.dtype} against a packed weight of "
                             f"{n} x {k} bf16")
        rows = x.reshape(-1, k)
        m = rows.shape[0]
        if m > MAX_ROWS:
            return F.linear(x, packed.weight, bias)
        padded_k = -(-k // KSTEP) * KSTEP
        if padded_k != k:  # whole tiles of k: zeros past them
            rows = F.pad(rows, (0, padded_k - k))
        elif not rows.is_contiguous():
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        y = torch.empty(m, n, dtype=torch.bfloat16)
        self._linear(rows.data_ptr(), m, padded_k, packed.tiles.data_ptr(), n,
                     None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y.view(*x.shape[:-1], n)

    def agrees_with_torch(self) -> bool:
        """Whether `linear` gives F.linear's bf16 result here to within one rounding of each output (odd shapes:
        padded rows, k and columns, a bias); logged when not."""
        g = torch.Generator().manual_seed(0)
        for m, n, k in ((1, 48, 32), (5, 40, 72), (16, 64, 512), (37, 150, 96)):
            w, b, x = (torch.randn(*size, generator=g).bfloat16() for size in ((n, k), (n,), (m, k)))
            want, got = F.linear(x, w, b).float(), self.linear(x, self.pack(w), b).float()
            exact = x.float() @ w.float().t() + b.float()
            # an output may round the other way from F.linear's: at most one bf16 step (2^-7 relative) apart
            if not torch.all((got - want).abs() <= want.abs() * 2**-7 + 1e-6) or not torch.allclose(
                    got, exact, rtol=2**-7, atol=(exact.abs().max() * 2**-7).item()):
                logger.info("native rollout: the bf16 projection kernel (%s) disagrees with F.linear here "
                            "(%d x %d x %d), so it is not used", self.kind, m, n, k)
                return False
        return True
