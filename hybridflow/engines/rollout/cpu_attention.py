"""The native rollout's decode attention on CPU as one C kernel (cpu_decode_attention.c), built on first use.

Why: torch's decode attention (kv_cache.decode_attention) is two batched matmuls over strided slices of the cache
plus a softmax; in bf16 oneDNN copies each strided slice before multiplying, and either way the rows' keys and
values make several passes through memory. The kernel reads each (row, KV head)'s keys and values once, straight
from the cache, and does scores, softmax and the weighted sum in fp32 (docs/benchmarks-history.md, "A decode-attention
kernel"): in bf16 a 64-row generate call took 0-15% less time with it (shape and run dependent). In fp32 it measured
level with torch's matmuls at first, and 3-14% faster once the projections ran on cpu_linear.py's kernel, so the
engine uses it by default in both (native_rollout.py, ``attention_kernel``). The arithmetic is the same up to fp32
rounding; bf16 keeps the softmax weights in fp32 where torch's path rounds them to bf16.

Build: on first use, for this CPU, cached per machine (c_kernels.py). Without a compiler, or when the build fails,
`load` logs why once and returns None: the rollout then uses torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from pathlib import Path

import torch

from hybridflow.engines.rollout.c_kernels import load_library

__all__ = ["DecodeAttentionKernel", "load"]

_SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
_DTYPES = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> DecodeAttentionKernel | None:
    """The kernel, built on first use (c_kernels.py); None where it cannot be built here. `extra_flags`: added
    compiler flags (``("-mno-avx512f",)`` builds the AVX2 variant, ``("-mno-avx",)`` the 4-wide one)."""
    lib = load_library(_SOURCE, "decode_attention", "decode-attention", "decode attention runs as torch matmuls",
                       extra_flags=extra_flags)
    return None if lib is None else DecodeAttentionKernel(lib)


class DecodeAttentionKernel:
    """kv_cache.decode_attention's computation as one call of the C kernel (same arguments, plus the rows'
    first attended column instead of the additive mask)."""

    def __init__(self, lib: ctypes.CDLL):
        i, f, ptr, long = ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_long
        self._functions = {}
        for dtype, name in _DTYPES.items():
            function = getattr(lib, name)
            function.argtypes = [i, i, i, i, ptr, ptr, f, f,  # R, KV, G, D, q, out, scale, softcap
                                 ptr, long, long, long, ptr, long, long, i, ptr,  # segment A, its prompt index
                                 ptr, long, long, long, ptr, long, long, i,  # segment B
                                 ptr, ptr, ptr, ptr, i]  # start, new key, new value, scratch, threads
            function.restype = None
            self._functions[dtype] = function
        # their addresses, for the decode-layer driver that calls them from C (cpu_decode_layer.py)
        self.addresses = {dtype: ctypes.cast(f, ctypes.c_void_p).value for dtype, f in self._functions.items()}
        self._last_pads = None  # (weak reference to a mask, its version and prompt length, its left pads)

    @staticmethod
    def supports(cache) -> bool:
        """Whether `cache` (kv_cache.KVCache) is in a dtype, device and layout the kernel reads."""
        keys, values = cache.keys[0], cache.values[0]
        parts = [keys, values] + ([cache.prompt_keys[0], cache.prompt_values[0]] if cache.shared else [])
        return (keys.dtype in _DTYPES and all(t.device.type == "cpu" and t.dtype == keys.dtype for t in parts)
                and all(t.stride(-1) == 1 for t in parts)
                and all(v.stride(-2) == v.shape[-1] for v in parts[1::2]))  # values: rows of head_dim

    def starts(self, prompt_bias: torch.Tensor, prompt_len: int, length: int, windows) -> dict | None:
        """Per sliding-window size of `windows` (None: full attention), the first attended column [rows] (int32) of
        the rows' prompt + `length` generated keys, from their prompt masks [rows, P] (0, or -inf at left padding).
        None when a mask is not left padding (then the additive-mask path is needed)."""
        pads = self._left_pads(prompt_bias, prompt_len)
        if pads is None:
            return None
        return {window: pads if window is None else pads.clamp(min=prompt_len + length - window)
                for window in windows}

    def _left_pads(self, prompt_bias: torch.Tensor, prompt_len: int) -> torch.Tensor | None:
        """Each row's count of left-padding columns [rows] (int32), or None when a mask is not left padding. A decode
        loop passes the same mask tensor every step until it drops rows, so the last answer is kept for it (checked
        by identity and torch's in-place version counter, which inference-mode tensors do not have: the engine
        replaces its mask when rows are dropped, never writes it in place)."""
        key = (None if prompt_bias.is_inference() else prompt_bias._version, prompt_len)
        last = self._last_pads
        if last is not None and last[0]() is prompt_bias and last[1] == key:
            return last[2]
        masked = torch.isinf(prompt_bias)
        pads = masked.sum(-1)
        if not torch.equal(masked, torch.arange(prompt_len, device=pads.device)[None] < pads[:, None]):
            pads = None
        else:
            pads = pads.to(torch.int32)
        self._last_pads = (weakref.ref(prompt_bias), key, pads)
        return pads

    def __call__(self, q: torch.Tensor, cache, layer: int, rows, start: torch.Tensor, length: int, scale: float,
                 softcap: float | None = None, keys: torch.Tensor | None = None,
                 values: torch.Tensor | None = None) -> torch.Tensor:
        """q [rows, kv, G, D] against the rows' prompt keys and first `length` generated keys -> [rows, kv, G, D].
        start [rows] int32: the first attended column (``starts``); rows: kv_cache.RunningRows. keys, values
        [rows, kv, D] (optional): generated token ``length - 1``'s, written into the cache first (as
        ``cache.write_token``) by the kernel itself."""
        G, D = q.shape[2], q.shape[3]
        q, start = q.contiguous(), start.to(torch.int32).contiguous()
        if keys is not None:
            dtype = cache.keys[layer].dtype
            keys, values = keys.to(dtype).contiguous(), values.to(dtype).contiguous()
        out = torch.empty_like(q)
        threads = torch.get_num_threads()
        a_keys, a_values, b_keys, b_values = self.segments(cache, layer)
        lenA, lenB = self.lengths(cache, length)
        prompt_index = rows.prompt_index.to(torch.int64).contiguous() if cache.shared else None
        scratch = self.scratch(threads, G, D, lenA + lenB)
        args = (q, out, scale, softcap, a_keys, a_values, lenA, prompt_index, b_keys, b_values, lenB, start, keys,
                values, scratch, threads)
        if torch.autograd._profiler_enabled():  # a named range in torch.profiler's tables (no op of its own)
            with torch.profiler.record_function("hybridflow::cpu_decode_attention"):
                self._call(*args)
        else:
            self._call(*args)
        return out

    @staticmethod
    def segments(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s (keys A, values A, keys B, values B): with a shared cache the prompt part (indexed by each
        row's prompt slot) and the rows' generated part; else the rows' one part twice (B then has length 0)."""
        if cache.shared:
            return cache.prompt_keys[layer], cache.prompt_values[layer], cache.keys[layer], cache.values[layer]
        return cache.keys[layer], cache.values[layer], cache.keys[layer], cache.values[layer]

    @staticmethod
    def lengths(cache, length: int) -> tuple[int, int]:
        """The attended lengths of segments A and B when `length` tokens have been generated."""
        return (cache.prompt_len, length) if cache.shared else (cache.offset + length, 0)

    @staticmethod
    def scratch(threads: int, G: int, D: int, length: int) -> torch.Tensor:
        """The kernel's per-thread work space for G query heads of D per KV head over `length` keys."""
        return torch.empty(threads * (2 * G * D + G * ((length + 15) // 16 * 16)), dtype=torch.float32)

    def _call(self, q, out, scale, softcap, a_keys, a_values, lenA, prompt_index, b_keys, b_values, lenB, start,
              keys, values, scratch, threads) -> None:
        r, kv, G, D = q.shape
        self._functions[q.dtype](
            r, kv, G, D, q.data_ptr(), out.data_ptr(), scale, softcap or 0.0,
            a_keys.data_ptr(), a_keys.stride(0), a_keys.stride(1), a_keys.stride(2),
            a_values.data_ptr(), a_values.stride(0), a_values.stride(1), lenA,
            None if prompt_index is None else prompt_index.data_ptr(),
            b_keys.data_ptr(), b_keys.stride(0), b_keys.stride(1), b_keys.stride(2),
            b_values.data_ptr(), b_values.stride(0), b_values.stride(1), lenB,
            start.data_ptr(), None if keys is None else keys.data_ptr(), None if values is None else values.data_ptr(),
            scratch.data_ptr(), threads,
        )
