"""The training engine's packed causal attention on CPU in fp32: one C call forward, one backward, for all the rows.

Why: torch's CPU flash-attention kernel runs at a third or less of the machine's matmul rate at RL's row lengths
(a few hundred tokens): its blocks are small products through the BLAS's general entry point, and a packed
micro-batch of rows of many lengths is one call per row (or per length) and layer, each with its own dispatch and
autograd node (docs/benchmarks-history.md, twentieth session). cpu_flash_attention.c computes the block-diagonal causal
attention of all the packed rows in one call each way, straight on the projections' [T, H, D] layout, with small
register-blocked products; its backward recomputes the probabilities from the forward's log-sum-exp (nothing of size
length squared is kept between the passes).

The result is the same attention up to fp32 rounding (sums in another order, its own exp): the tests hold it to
fp64 SDPA, and the gradients to autograd's through fp64 SDPA. A packing engine on CPU marks its attention modules
(`use_flash_attention`, EngineConfig.cpu_flash_attention); their packed calls, rows of their own or shared-prompt
groups (shared_prompts.py), take the kernel without dropout where the head size is a multiple of the vector width.
In bf16 (the engine's autocast) the operands are rounded to bf16 as SDPA's would be and the attention is computed in
fp32 from them, its output rounded to bf16: where SDPA's bf16 kernel rounds the probabilities to bf16 as well, this
is closer to the exact result (the backward was fp32 already: causal_attention.py). Dropout, other devices and the
batch-invariant mode keep their own attention.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.engines.causal_attention import sdpa_dtype
from hybridflow.engines.rollout.c_kernels import load_library

__all__ = ["FlashAttentionKernel", "Layout", "flash_attention_here", "load", "packed_causal_attention", "rows_layout",
           "shared_layout", "takes", "use_flash_attention"]

_SOURCE = Path(__file__).with_name("cpu_flash_attention.c")
# queries per block: each block's scores cover keys up to its last query, so a larger block computes more masked
# scores, a smaller one passes over the keys (and, in the backward, the key/value gradients) more often
QUERY_BLOCK = 48


@dataclass(frozen=True)
class Layout:
    """Which keys each packed query attends to (cpu_flash_attention.c): `sequences` [S, 4] int64 rows (query start,
    query count, prefix start, prefix length), the queries attending causally to themselves and fully to the prefix;
    `groups` [N + 1] int64, the sequences of each group of shared keys; `width`, the longest row of scores (prefix
    and own keys, each rounded up to the vector width)."""

    sequences: torch.Tensor
    groups: torch.Tensor
    width: int


class FlashAttentionKernel:
    """cpu_flash_attention.c's entry points."""

    def __init__(self, lib: ctypes.CDLL):
        i, long, f, ptr = ctypes.c_int, ctypes.c_long, ctypes.c_float, ctypes.c_void_p
        self.vector_width = lib.flash_attention_vector_width()
        self._keys = lib.flash_keys_transposed
        # T, G, D, k, skt, skh, kt, ldkt, threads
        self._keys.argtypes = [long, i, i, ptr, long, long, ptr, long, i]
        self._keys.restype = None
        self._forward = lib.flash_forward_f32
        # T, nseq, seq, H, G, D, BQ, q, sqt, sqh, kt, ldkt, v, svt, svh, scale, out, lse, scratch, ldS, threads
        self._forward.argtypes = [long, i, ptr, i, i, i, i, ptr, long, long, ptr, long, ptr, long, long, f, ptr, ptr,
                                  ptr, long, i]
        self._forward.restype = None
        self._backward = lib.flash_backward_f32
        # T, seq, ngroups, group, H, G, D, BQ, q, sqt, sqh, k, skt, skh, v, svt, svh, out, dout, sdt, sdh, lse, scale,
        # dq, dk, dv, delta, scratch, ldS, threads
        self._backward.argtypes = [long, ptr, i, ptr, i, i, i, i, ptr, long, long, ptr, long, long, ptr, long, long,
                                   ptr, ptr, long, long, ptr, f, ptr, ptr, ptr, ptr, ptr, long, i]
        self._backward.restype = None

    def round_up(self, n: int) -> int:
        return -(-n // self.vector_width) * self.vector_width

    def layout(self, sequences: list[tuple[int, int, int, int]], groups: list[int]) -> Layout:
        """A Layout of `sequences` (query start, query count, prefix start, prefix length) and group offsets."""
        width = max((self.round_up(lp) + self.round_up(lq) for _, lq, _, lp in sequences), default=0)
        return Layout(torch.tensor(sequences, dtype=torch.int64).reshape(-1, 4),
                      torch.tensor(groups, dtype=torch.int64), width)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, G, D] (strided rows, last dimension contiguous) -> (out [T, H, D], lse [H, T])."""
        T, H, D = q.shape
        G = k.shape[1]
        threads = torch.get_num_threads()
        kt = torch.empty(G, D, T + self.vector_width)
        out, lse = torch.empty(T, H, D), torch.empty(H, T)
        scratch = torch.empty(threads * QUERY_BLOCK * layout.width)
        self._keys(T, G, D, k.data_ptr(), k.stride(0), k.stride(1), kt.data_ptr(), kt.stride(1), threads)
        self._forward(T, layout.sequences.shape[0], layout.sequences.data_ptr(), H, G, D, QUERY_BLOCK, q.data_ptr(),
                      q.stride(0), q.stride(1), kt.data_ptr(), kt.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                      scale, out.data_ptr(), lse.data_ptr(), scratch.data_ptr(), layout.width, threads)
        return out, lse

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 grad: torch.Tensor, layout: Layout,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gradients (dq [T, H, D], dk and dv [T, G, D], contiguous) for the output's gradient `grad`
        [T, H, D] (strided rows)."""
        T, H, D = q.shape
        G = k.shape[1]
        threads = torch.get_num_threads()
        dq, dk, dv = torch.empty(T, H, D), torch.empty(T, G, D), torch.empty(T, G, D)
        delta = torch.empty(H, T)
        scratch = torch.empty(threads * (2 * D + 2 * QUERY_BLOCK) * layout.width)
        seq, groups = layout.sequences, layout.groups
        self._backward(T, seq.data_ptr(), groups.numel() - 1, groups.data_ptr(), H, G, D, QUERY_BLOCK,
                       q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                       v.stride(0), v.stride(1), out.data_ptr(), grad.data_ptr(), grad.stride(0), grad.stride(1),
                       lse.data_ptr(), scale, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), delta.data_ptr(),
                       scratch.data_ptr(), layout.width, threads)
        return dq, dk, dv


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> FlashAttentionKernel | None:
    """The kernel, built on first use (c_kernels.py); None where it does not build here. `extra_flags`: added to
    the compiler's (tests build the narrower vector widths with them)."""
    lib = load_library(_SOURCE, "flash_attention", "training attention",
                       "the training engine keeps torch's scaled_dot_product_attention", extra_flags=extra_flags)
    return None if lib is None else FlashAttentionKernel(lib)


def flash_attention_here(device: torch.device, setting: bool | None = None) -> bool:
    """Whether the engine's packed attention takes the kernel: `setting` when given (True where it cannot run is an
    error), else on CPU where it builds."""
    possible = torch.device(device).type == "cpu"
    if setting is None:
        return possible and load() is not None
    if setting and not (possible and load() is not None):
        raise ValueError(f"cpu_flash_attention=True needs a CPU where the C kernel builds (device {device}; see the "
                         "log for the build's error); leave it unset (None) to choose")
    return bool(setting)


def use_flash_attention(model: torch.nn.Module) -> int:
    """Mark `model`'s attention modules so that packing.varlen_attention takes the kernel for their calls where
    `takes` holds; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            module.hybridflow_flash_attention = True
            count += 1
    return count


def _plain(t: torch.Tensor) -> bool:
    return (t.dtype in (torch.float32, torch.bfloat16) and t.device.type == "cpu" and type(t.data) is torch.Tensor
            and t.stride(-1) == 1)


def takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float) -> bool:
    """Whether `packed_causal_attention` computes this call: packed CPU operands [1, heads, T, D] that SDPA would
    compute in fp32 or bf16 (under bf16 autocast too), no dropout, query heads a multiple of the key/value heads, D a
    multiple of the vector width."""
    if dropout or torch.compiler.is_compiling() or not all(_plain(t) for t in (query, key, value)):
        return False
    if sdpa_dtype(query, key, value) not in (torch.float32, torch.bfloat16):
        return False
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[0] != 1:
        return False
    H, T, D = query.shape[1:]
    G = key.shape[1]
    if key.shape != (1, G, T, D) or value.shape != key.shape or G == 0 or H % G:
        return False
    kernel = load()
    return kernel is not None and D % kernel.vector_width == 0


class _PackedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, layout, scale):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D] views
        out, lse = load().forward(q, k, v, layout, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out[None]

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        grad = grad[0] if grad.stride(-1) == 1 else grad[0].contiguous()
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        dq, dk, dv = load().backward(q, k, v, out, lse, grad, ctx.layout, ctx.scale)
        return dq[None].transpose(1, 2), dk[None].transpose(1, 2), dv[None].transpose(1, 2), None, None


def rows_layout(cu_seq_lens: torch.Tensor) -> Layout:
    """Packed rows [cu[r], cu[r + 1]), each attending causally to itself."""
    cu = cu_seq_lens.tolist()
    rows = [(lo, hi - lo, 0, 0) for lo, hi in itertools.pairwise(cu)]
    return load().layout(rows, list(range(len(rows) + 1)))


def shared_layout(groups: list[tuple[int, int, list[tuple[int, int]]]], tokens: int) -> Layout | None:
    """Shared-prompt groups (shared_prompts.SharedPrompts.groups: prompt start and length, then the responses'
    starts and lengths): each prompt attends causally to itself, each response fully to its prompt and causally to
    itself. None when the groups do not cover the `tokens` packed tokens once each."""
    sequences, offsets = [], [0]
    for start, length, responses in groups:
        sequences += [(start, length, 0, 0)] + [(rs, rl, start, length) for rs, rl in responses if rl > 0]
        offsets.append(len(sequences))
    end = 0  # the queries' spans, in order, must tile [0, tokens)
    for qs, lq, _, _ in sorted(sequences):
        if lq == 0:
            continue
        if qs != end:
            return None
        end = qs + lq
    if end != tokens:
        return None
    return load().layout(sequences, offsets)


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Layout,
                            scale: float | None) -> torch.Tensor:
    """query [1, H, T, D], key/value [1, G, T, D] (H a multiple of G), the packed rows' `layout` -> their attention
    [1, T, H, D] (contiguous), where `takes` holds."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if sdpa_dtype(query, key, value) == torch.float32:
        return _PackedCausal.apply(query, key, value, layout, float(scale))
    # bf16: the operands rounded to bf16 as SDPA's (autocast's casts), the attention computed in fp32 from them, the
    # output rounded to bf16; the gradients pass back through the same casts (rounded to bf16, as SDPA's are)
    query, key, value = (t.to(torch.bfloat16).float() for t in (query, key, value))
    with torch.autocast("cpu", enabled=False):
        return _PackedCausal.apply(query, key, value, layout, float(scale)).to(torch.bfloat16)
