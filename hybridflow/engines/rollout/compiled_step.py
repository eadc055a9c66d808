"""The fixed-shape decode step compiled with torch.compile (inductor): the CPU counterpart of CUDA graphs.

A decode step of a small or mid-sized model on CPU is a few hundred small ops per token step (norms, rotary, the
attention's softmax and masks, residual adds), each a separate pass over memory plus Python and dispatcher overhead.
Inductor fuses the elementwise and reduction ops between the matmuls into generated C++ loops. The step it compiles is
static_decode.py's ``decode_static``: fixed-shape buffers, the cache column to write a tensor, so every step of a
generate call — and of every later call of the same row/length bucket — runs the same compiled code.

The matmuls stay the decoder's own: the packed weights (oneDNN's layout, onednn_linear.py; int8, int8_linear.py) are
opaque tensors that the compiler cannot trace, so inside a compiled step each projection is one call of the custom op
``hybridflow::packed_linear`` (``packed_linear``), which looks the decoder up by key and runs its packed matmul
eagerly. Likewise an MoE layer's expert dispatch (moe.py), which reads group sizes on the host, is one call of
``hybridflow::routed_experts``; its routing (router matmul, softmax, top-k) is compiled with the rest. The packed weights are therefore read at run time: a weight update (re-packing, native_model.py) needs no
recompilation, and the compiled code reads the decoder's other tensors (norms, embeddings, the cache buffers) as
inputs, written in place by updates.

Costs: the first step of each new shape compiles (tens of seconds on 2 cores for the mid model; inductor caches the
generated code on disk, so a later process compiles faster). After the first shape, dynamo's automatic dynamic
shapes compile one graph with symbolic rows/length for the other buckets (the rows shrink as samples finish).
Arithmetic: the fused elementwise code may round differently from the eager ops (fp32 sums reordered), so logits
can differ by ~1e-6; tests check greedy compiled == eager token for token.
"""

from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["compile_decode_step", "packed_linear", "register_decoder", "routed_experts"]

# keys are strings: dynamo specialises strings, while an int attribute that differs between two decoders' compiles
# would be turned into a symbolic int
_DECODERS: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()
_KEYS = itertools.count()
# the compiled step is recompiled per (rows, length) bucket until dynamo turns the shapes symbolic, and once per
# decoder; the default limit (8) would silently fall back to eager in a process holding several engines
_RECOMPILE_LIMIT = 64


def register_decoder(decoder) -> str:
    """A key under which ``packed_linear`` finds `decoder` (a NativeDecoder); held weakly."""
    key = f"decoder{next(_KEYS)}"
    _DECODERS[key] = decoder
    return key


def _decoder(key: str):
    decoder = _DECODERS.get(key)
    if decoder is None:
        raise RuntimeError(f"compiled decode step: decoder {key} is gone (its engine was deleted)")
    return decoder


@torch.library.custom_op("hybridflow::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, key: str, layer: int, name: str, expert: int) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype: decoder `key`'s packed projection `name` of layer `layer` (-1: the
    output head), or of routed expert `expert` (>= 0) (NativeDecoder.packed_linear)."""
    return _decoder(key).packed_linear(layer, name, x, expert)


@packed_linear.register_fake
def _(x: torch.Tensor, key: str, layer: int, name: str, expert: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _decoder(key).packed_out(layer, name, expert)))


@torch.library.custom_op("hybridflow::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, key: str, layer: int) -> torch.Tensor:
    """MoE layer `layer` of decoder `key`: tokens x [T, H] through their routed experts [T, k] (weights [T, k]) ->
    [T, H] (moe.dispatch, which reads the group sizes on the host)."""
    return _decoder(key).routed_experts(layer, x, weights, experts)


@routed_experts.register_fake
def _(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, key: str, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


def compile_decode_step(decoder):
    """``decoder.decode_static`` compiled with inductor (see the module docstring); call it with StepBuffers."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    decoder.compile_key()  # registered before tracing: the traced step only reads the key
    return torch.compile(decoder.decode_static, backend="inductor", fullgraph=True)
