"""A routed layer's routing in C for the bf16 decode step on CPU (cpu_moe_router.cpp): moe.route_logits' bits.

Why: the one-call bf16 step (cpu_bf16_step.py) ran each routed layer's router in torch, called back from C. There a
handful of small torch ops (softmax, top-k, a division) ran on caches the step had just filled with weights, at
several times their cost in a warm loop, and made most of the gap between a Qwen3-MoE step and a dense one
(docs/benchmarks.md, thirty-fifth session). Here the router's product is the decoder's AMX product of its packed
router weight (as every other projection of that step), and the softmax, top-k and renormalisation are one C call
that reproduces torch's: the same vector exp (Sleef's, from libtorch), the same summation orders, the same
selection algorithms with the same comparison. `load` checks it against moe.route_logits on random logits and on
logits with many ties before a decoder uses it; where the check fails, the file does not build (no C++ compiler) or
torch does not run its AVX-512 kernels, the step keeps torch's router.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from hybridflow.engines.rollout.c_kernels import load_library
from hybridflow.engines.rollout.cpu_decode_layer import torch_vector_function
from hybridflow.engines.rollout.moe import route_logits

__all__ = ["MoeRouterKernel", "load"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_moe_router.cpp")


class MoeRouterKernel:
    """``route(logits, k, normalize)`` = moe.route_logits on bf16 logits [R, E], bit for bit; ``address`` and
    ``exp`` for C callers (cpu_decode_layer.c's bf16 step)."""

    def __init__(self, lib: ctypes.CDLL, exp: int):
        long, ptr = ctypes.c_long, ctypes.c_void_p
        self._route = lib.route_bf16
        # R, E, k, normalize, logits, exp, weights, experts, scratch
        self._route.argtypes = [long, long, long, ctypes.c_int, ptr, ptr, ptr, ptr, ptr]
        self._route.restype = None
        self._scratch = lib.route_scratch_bytes
        self._scratch.argtypes = [long]
        self._scratch.restype = long
        self.address = ctypes.cast(self._route, ptr).value
        self.exp = exp

    def scratch_bytes(self, experts: int) -> int:
        """Bytes of scratch one call needs for `experts` experts."""
        return self._scratch(experts)

    def route(self, logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 logits [R, E] -> (weights [R, k] bf16, expert ids [R, k] int64)."""
        if logits.dtype != torch.bfloat16 or logits.dim() != 2 or not 0 < k <= logits.shape[1]:
            raise ValueError(f"MoE router: logits {tuple(logits.shape)} {logits.dtype} with k={k}; expected bf16 "
                             "[rows, experts] and 0 < k <= experts")
        logits = logits.contiguous()
        R, E = logits.shape
        weights = torch.empty(R, k, dtype=torch.bfloat16)
        experts = torch.empty(R, k, dtype=torch.int64)
        scratch = torch.empty(self.scratch_bytes(E), dtype=torch.uint8)
        self._route(R, E, k, int(normalize), logits.data_ptr(), self.exp, weights.data_ptr(), experts.data_ptr(),
                    scratch.data_ptr())
        return weights, experts

    def agrees_with_torch(self) -> bool:
        """Whether `route` gives moe.route_logits' weights and experts bit for bit here, on random logits and on
        logits drawn from a few values (ties, which torch's selection orders its own way); logged when not."""
        g = torch.Generator().manual_seed(0)
        for experts, k in ((4, 2), (8, 1), (8, 3), (16, 4), (60, 4), (64, 1), (128, 8), (128, 1)):
            for levels in (None, 3, 40):
                if levels is None:
                    logits = torch.randn(512, experts, generator=g) * 4
                else:
                    logits = torch.randint(0, levels, (512, experts), generator=g) * 0.25 - 2
                logits = logits.bfloat16()
                for normalize in (True, False):
                    want, got = route_logits(logits, k, normalize), self.route(logits, k, normalize)
                    if not (torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])):
                        logger.info("native rollout: the C MoE router disagrees with torch's here (%d experts, "
                                    "top-%d), so the bf16 decode step calls torch's router", experts, k)
                        return False
        return True


@functools.cache
def load() -> MoeRouterKernel | None:
    """The kernel, built on first use (c_kernels.py) and checked against torch; None where it does not run here."""
    exp = torch_vector_function("exp")
    if exp is None or exp[1] != 16:  # the summation order reproduced is that of torch's AVX-512 kernels
        return None
    lib = load_library(_SOURCE, "moe_router", "MoE router", "the bf16 decode step calls torch's router",
                       fast_math=False, extra_flags=("-ffp-contract=off",))
    if lib is None:
        return None
    kernel = MoeRouterKernel(lib, exp[0])
    return kernel if kernel.agrees_with_torch() else None
