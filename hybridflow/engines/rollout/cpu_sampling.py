"""A decode step's token choice on CPU as one C call (cpu_sampling.c), with or without top-k and top-p: built on first use.

Why: sampling.py's torch path is a dozen ops over [rows, vocabulary] per step (logsumexp's own eight, the
probabilities, an fp64 cumulative sum, two searches, a gather), each a pass over memory with a fresh buffer: at
64 rows of a real vocabulary it costs milliseconds a step, at the tiny models' 16 rows of 288 tokens its per-op
overhead is a large part of a step (``benchmarks/sampling_cost.py``; docs/benchmarks.md). The C call reads each row
twice (its max; its exps summed in fp64 per block) and one block of it a third time (the inverse CDF).

Semantics are sampling.py's: log-probs are log_softmax(logits / temperature) at the chosen token (greedy: argmax,
first index of the max, temperature-1 log-prob); draws are the inverse CDF at the given uniforms. Arithmetic differs
by rounding only: the normaliser is summed in fp64 (the reported log-prob is closer to the fp64 value than torch's
fp32 logsumexp), and the CDF is summed per block, so a draw sitting within rounding of a token boundary may pick its
neighbour. The training engine computes its log-probs on CPU with the same normaliser (`SamplingKernel.log_probs`,
hf_model.log_probs_from_logits), so for the same logits the two agree bit for bit.

Top-k and top-p keep sampling.py's tokens: the probabilities in descending order (equal ones in index order), the
first top_k, then the shortest prefix whose mass reaches top_p of theirs, drawn by inverse CDF in that order. torch's
path sorts candidates (a `topk` of 1,024, more when the prefix is longer); the C call finds each cut, and the draw,
by walking a histogram of the exps' bits from the top, then the elements of the one bin where the running count or
mass passes its target (cpu_sampling.c). At 64 rows of SmolLM2's 49,152 tokens torch's top-p 0.9 took 26-89 ms a
step, depending on how flat the logits are (``benchmarks/sampling_cost.py``). As there, masses are summed in another
order than the sorted cumulative sum, and exp() may round two neighbours to one fp32 value in one path and not the
other, so a cut or a draw within rounding of a boundary may pick the neighbouring token.

Build: on first use, for this CPU, cached per machine (c_kernels.py). Without a compiler, or when the build fails,
`load` logs why once and returns None: sampling keeps torch's path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from hybridflow.engines.rollout.c_kernels import load_library

__all__ = ["BLOCK", "SamplingKernel", "filtered_scratch_error", "load"]

_SOURCE = Path(__file__).with_name("cpu_sampling.c")
BLOCK = 64  # the C file's BLOCK: a row's exps are summed per block of this many


@functools.cache
def load() -> SamplingKernel | None:
    """The kernel, built on first use (c_kernels.py); None where it cannot be built here."""
    # no fast math: infinities are checked (masked logits are -inf) and the temperature divides, as torch's
    # `logits / temperature`; the C file declares glibc's vector expf itself, which needs no errno
    lib = load_library(_SOURCE, "sampling", "sampling", "sampling keeps torch's ops", fast_math=False,
                       extra_flags=("-fno-math-errno",))
    return None if lib is None else SamplingKernel(lib)


def filtered_scratch_error(rows: int, vocab: int) -> str:
    return (f"sampling: no memory for the top-k/top-p scratch of {rows} rows x {vocab} tokens "
            f"(~{36 * vocab * min(rows, torch.get_num_threads()) >> 20} MiB)")


class SamplingKernel:
    """``choose(logits, uniforms, temperature, top_k, top_p)``: (tokens [R] int64, log_probs [R] fp32), or None where
    a row holds a NaN, a +inf or only -inf (the caller reports those) or the vocabulary is empty."""

    def __init__(self, lib: ctypes.CDLL):
        self._sample = lib.sample_rows_f32
        p, long_, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        self._sample.argtypes = [long_, long_, p, long_, ctypes.c_float, int_, p, p, p, p, int_]
        self._sample.restype = long_
        self._filtered = lib.sample_filtered_rows_f32
        self._filtered.argtypes = [long_, long_, p, long_, ctypes.c_float, long_, ctypes.c_double, p, p, p, int_]
        self._filtered.restype = long_
        self._log_probs = lib.log_probs_f32
        self._log_probs.argtypes = [long_, long_, p, long_, p, p, p, p, p, int_]
        self._log_probs.restype = long_
        self._log_probs_backward = lib.log_probs_backward_f32
        self._log_probs_backward.argtypes = [long_, long_, p, long_, p, p, p, p, p, p, long_, int_]
        self._log_probs_backward.restype = None
        # for C callers (cpu_decode_layer.c's loop): sample_rows_f32 and sample_filtered_rows_f32
        self.address = ctypes.cast(self._sample, ctypes.c_void_p).value
        self.filtered_address = ctypes.cast(self._filtered, ctypes.c_void_p).value

    def choose(self, logits: torch.Tensor, uniforms: torch.Tensor | None, temperature: float, top_k: int = 0,
               top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """logits [R, V] on CPU (fp32, or converted); uniforms [R] float64 in [0, 1), or None for greedy (which
        ignores top_k and top_p). top_k <= 0 or >= V, and top_p >= 1, do not filter."""
        logits = logits.float()
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        R, V = logits.shape
        if V == 0:
            return None
        greedy = uniforms is None
        if not greedy:
            uniforms = uniforms.to(torch.float64).contiguous()
        tokens = torch.empty(R, dtype=torch.int64)
        log_probs = torch.empty(R, dtype=torch.float32)
        if not greedy and (0 < top_k < V or top_p < 1.0):
            undecided = self._filtered(R, V, logits.data_ptr(), logits.stride(0), float(temperature), int(top_k),
                                       float(top_p), uniforms.data_ptr(), tokens.data_ptr(), log_probs.data_ptr(),
                                       torch.get_num_threads())
            if undecided < 0:
                raise MemoryError(filtered_scratch_error(R, V))
            return None if undecided else (tokens, log_probs)
        sums = torch.empty(R, -(-V // BLOCK), dtype=torch.float64)
        undecided = self._sample(R, V, logits.data_ptr(), logits.stride(0), float(temperature), int(greedy),
                                 None if greedy else uniforms.data_ptr(), tokens.data_ptr(), log_probs.data_ptr(),
                                 sums.data_ptr(), torch.get_num_threads())
        return None if undecided else (tokens, log_probs)

    def log_probs(self, logits: torch.Tensor, targets: torch.Tensor, entropy: bool = False) -> tuple[torch.Tensor, ...]:
        """logits [R, V] fp32 on CPU, last dimension contiguous (already divided by the temperature), targets [R]
        -> (log_probs [R] fp32, lse [R] fp64), each log-prob the value `choose` reports for that token of those
        logits, bit for bit (the C file's last section); with entropy also (entropy [R] fp32, mean [R] fp64: the
        probability-weighted mean logit, for the backward). An IndexError, as torch's gather's, for a target outside
        [0, V)."""
        R, V = logits.shape
        targets = targets.to(torch.int64).contiguous()
        log_probs = torch.empty(R, dtype=torch.float32)
        lse = torch.empty(R, dtype=torch.float64)
        ent = torch.empty(R, dtype=torch.float32) if entropy else None
        mean = torch.empty(R, dtype=torch.float64) if entropy else None
        bad = self._log_probs(R, V, logits.data_ptr(), logits.stride(0), targets.data_ptr(), log_probs.data_ptr(),
                              lse.data_ptr(), None if ent is None else ent.data_ptr(),
                              None if mean is None else mean.data_ptr(), torch.get_num_threads())
        if bad:
            raise IndexError(f"log-probs: {bad} of {R} target ids are outside the vocabulary [0, {V}) of the logits")
        return (log_probs, lse) if not entropy else (log_probs, lse, ent, mean)

    def log_probs_backward(self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                           entropy_grad: torch.Tensor | None = None, mean: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient [R, V] of `log_probs`'s outputs for the log-probs' gradient grad [R] and, with entropy, the
        entropy's entropy_grad [R] (None: no entropy term); the other tensors are `log_probs`' own."""
        R, V = logits.shape
        grad = grad.to(torch.float32).contiguous()
        if entropy_grad is not None:
            entropy_grad = entropy_grad.to(torch.float32).contiguous()
        out = torch.empty(R, V, dtype=torch.float32)
        self._log_probs_backward(R, V, logits.data_ptr(), logits.stride(0), targets.data_ptr(), lse.data_ptr(),
                                 grad.data_ptr(), None if entropy_grad is None else entropy_grad.data_ptr(),
                                 None if mean is None else mean.data_ptr(), out.data_ptr(), V,
                                 torch.get_num_threads())
        return out
