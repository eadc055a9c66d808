"""A routed layer's routing in C for the decode steps on CPU (cpu_moe_router.cpp): moe.route_logits' bits.

Why: the one-call bf16 step (cpu_bf16_step.py) ran each routed layer's router in torch, called back from C. There a
handful of small torch ops (softmax, top-k, a division) ran on caches the step had just filled with weights, at
several times their cost in a warm loop, and made most of the gap between a Qwen3-MoE step and a dense one
(docs/benchmarks-history.md, thirty-fifth session). Here the router's product is the decoder's bf16 tile product of its
packed router weight (as every other projection of that step), and the softmax, top-k and renormalisation are one C call
that reproduces torch's: the same vector exp (Sleef's, from libtorch), the same summation orders, the same selection
algorithms with the same comparison. `agrees` checks it against moe.route_logits for a router's shape
(experts, k, renormalised or not, dtype) on random logits and on logits with many ties before a decoder routes with
it; where the check fails, the file does not build (no C++ compiler) or torch does not run its AVX-512 kernels, the
step keeps torch's router. The fp32 decode step (cpu_decode_layer.py),
whose routed layers run as two C calls with the router between them, keeps torch's product (F.linear) for the
router's logits and takes the rest from here: the same bits, one call instead of five ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from hybridflow.engines.rollout.c_kernels import load_library, torch_vector_function
from hybridflow.engines.rollout.moe import route_logits

__all__ = ["MoeRouterKernel", "load"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_moe_router.cpp")


class MoeRouterKernel:
    """``route(logits, k, normalize)`` = moe.route_logits on bf16 or fp32 logits [R, E], bit for bit; ``address``
    (the bf16 function) and ``exp`` for C callers (cpu_decode_layer.c's bf16 step)."""

    def __init__(self, lib: ctypes.CDLL, exp: int):
        long, ptr = ctypes.c_long, ctypes.c_void_p
        self._route = {torch.bfloat16: lib.route_bf16, torch.float32: lib.route_f32}
        for function in self._route.values():
            # R, E, k, normalize, logits, exp, weights, experts, scratch
            function.argtypes = [long, long, long, ctypes.c_int, ptr, ptr, ptr, ptr, ptr]
            function.restype = None
        self._scratch = lib.route_scratch_bytes
        self._scratch.argtypes = [long]
        self._scratch.restype = long
        self.address = ctypes.cast(self._route[torch.bfloat16], ptr).value
        self.exp = exp
        self._agrees: dict[tuple, bool] = {}

    def scratch_bytes(self, experts: int) -> int:
        """Bytes of scratch one call needs for `experts` experts."""
        return self._scratch(experts)

    def route(self, logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 or fp32 logits [R, E] on CPU -> (weights [R, k] in their dtype, expert ids [R, k] int64)."""
        if (logits.dtype not in self._route or logits.device.type != "cpu" or logits.dim() != 2
                or not 0 < k <= logits.shape[1]):
            raise ValueError(f"MoE router: logits {tuple(logits.shape)} {logits.dtype} on {logits.device} with "
                             f"k={k}; expected bf16 or fp32 [rows, experts] on CPU and 0 < k <= experts")
        logits = logits.contiguous()
        R, E = logits.shape
        weights = torch.empty(R, k, dtype=logits.dtype)
        experts = torch.empty(R, k, dtype=torch.int64)
        scratch = torch.empty(self.scratch_bytes(E), dtype=torch.uint8)
        self._route[logits.dtype](R, E, k, int(normalize), logits.data_ptr(), self.exp, weights.data_ptr(),
                                  experts.data_ptr(), scratch.data_ptr())
        return weights, experts

    def agrees(self, experts: int, k: int, normalize: bool, dtype: torch.dtype) -> bool:
        """Whether `route` gives moe.route_logits' weights and experts bit for bit here for a router of `experts`
        experts, top-`k`, on random logits and on logits drawn from a few values (ties, which torch's selection orders
        its own way) at several row counts; asked once per shape, logged when not. (torch sums the k weights in an
        order that depends on k, so each shape a decoder routes with is checked.)"""
        key = (experts, k, bool(normalize), dtype)
        if key not in self._agrees:
            self._agrees[key] = self._check(*key)
            if not self._agrees[key]:
                logger.info("native rollout: the C MoE router disagrees with torch's here (%d experts, top-%d, %s), "
                            "so the decode steps keep torch's router", experts, k, dtype)
        return self._agrees[key]

    def _check(self, experts: int, k: int, normalize: bool, dtype: torch.dtype) -> bool:
        # bf16 logits are routed in fp32 and the weights rounded once: the fp32 results on the same (bf16) values
        # show an fp32 difference that the rounding would hide in most rows
        g = torch.Generator().manual_seed(experts * 1000 + k)
        for rows in (1, 5, 64, 256, 1024):
            for levels in (None, 3, 40):
                if levels is None:
                    logits = torch.randn(rows, experts, generator=g) * 4
                else:
                    logits = torch.randint(0, levels, (rows, experts), generator=g) * 0.25 - 2
                for typed in {dtype, torch.float32}:
                    typed_logits = logits.to(dtype).to(typed)
                    want, got = route_logits(typed_logits, k, normalize), self.route(typed_logits, k, normalize)
                    if not (torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])):
                        return False
        return True


@functools.cache
def load() -> MoeRouterKernel | None:
    """The kernel, built on first use (c_kernels.py); None where it does not run here. Callers ask `agrees` for their
    router's shape before routing with it."""
    exp = torch_vector_function("exp")
    if exp is None or exp[1] != 16:  # the summation order reproduced is that of torch's AVX-512 kernels
        return None
    lib = load_library(_SOURCE, "moe_router", "MoE router", "the decode steps keep torch's router",
                       fast_math=False, extra_flags=("-ffp-contract=off",))
    if lib is None:
        return None
    return MoeRouterKernel(lib, exp[0])
