"""An eager bf16 decode step on CPU in fewer ops: NativeDecoder._layers with its small ops as C calls.

Why: the fp32 decode step is one C call (cpu_decode_layer.py), but its driver calls fp32 kernels; in bf16 the
projections are calls of their own (AMX tiles, cpu_amx_linear.py, or oneDNN's packed product), and between them the
eager step ran a dozen ops a layer (norms, residual adds, rotation, the attention kernel's copies of q, k and v, the
gate's silu and product, slicing and views), each with its dispatch, allocation and a trip through memory. Here each
layer is its projections plus four C calls:

    qkv_heads      the attention's inputs from the qkv projection: q/k norms (Qwen3, Gemma 3), rotation, contiguous
                   q, k, v (cpu_step_ops.py)
    add_rms_norm   the attention block's residual add and the MLP's input norm (Gemma: the block output's own norm
                   first), the residual stream updated in place (cpu_step_ops.py)
    act_mul        the MLP's gate, act(gate) * up (cpu_decode_layer.py; routed experts keep torch's dispatch and take
                   it per expert in native_model._expert_mlp)
    add_rms_norm   the MLP's residual add and the next layer's input norm, or the final norm after the last layer

Exactness: each C call computes what the ops it replaces compute, bit for bit (torch's bf16 add; the step-op kernels'
norm and rotation; the gate checked against torch's per width and thread count, else torch's ops run), so tokens and
log-probs are the op-by-op step's (tests/engines/test_cpu_decode_layer.py). It applies to a CPU bf16 decoder whose
rollout engine set the step-op and decode-layer kernels (native_rollout.py), outside tensor parallelism.
"""

from __future__ import annotations

import torch

__all__ = ["applies", "layers"]


def applies(decoder, kernel) -> bool:
    """Whether `decoder`'s eager decode step runs as `layers` with `kernel` (its cpu_decode_layer
    DecodeLayerKernel): bf16 on CPU with the step-op kernels active (inside NativeDecoder.decode), eagerly
    (torch.compile traces _layers)."""
    return (kernel is not None and decoder.dtype == torch.bfloat16 and decoder.device.type == "cpu"
            and hasattr(decoder._step_ops, "add_rms_norm") and hasattr(kernel, "act_mul")
            and not torch.compiler.is_compiling())


def layers(decoder, tokens: torch.Tensor, positions: torch.Tensor, attend, kernel) -> torch.Tensor:
    """Every layer of one decode step for tokens [rows] at positions [rows], ``attend`` as NativeDecoder._layers takes
    it; returns the final norm's output [rows, hidden] (the output head's input)."""
    s, ops, eps, offset = decoder.shape, decoder._step_ops, decoder.shape.rms_norm_eps, decoder.offset_norm
    sandwich, qk_norm, rope = decoder.spec.sandwich_norms, decoder.spec.qk_norm, decoder.rope
    x = decoder._embed(tokens)
    if decoder.embed_scale is not None:
        x = x * decoder.embed_scale
    x = x.contiguous()  # the residual stream, added to in place
    # the attention's inputs as one call where the kernel reads the rotary tables in place
    heads = ops.reads_tables(rope) and all(t.dtype == torch.bfloat16 for t in rope.cos.values())
    rotate = None if heads else decoder._rotation(positions)
    h = decoder._rms(x, decoder.layers[0]["input_layernorm"])
    for li, layer in enumerate(decoder.layers):
        if heads:
            key = s.layers[li].rope
            qkv = ops.qkv_heads(decoder._linear(li, "qkv", h), s.num_heads, s.num_kv_heads,
                                layer["q_norm"] if qk_norm else None, layer["k_norm"] if qk_norm else None, eps, offset,
                                rope.cos[key], rope.sin[key], positions)
        else:
            qkv = decoder._qkv(li, h, rotate)
        out = decoder._linear(li, "o", attend(li, *qkv))
        h = ops.add_rms_norm(x, out, layer["post_attention_layernorm"] if sandwich else None,
                             layer["pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"], eps,
                             offset)
        if s.layers[li].moe:
            mlp = decoder._mlp(li, h).contiguous()
        else:
            gate_up = decoder._linear(li, "gate_up", h)
            act = kernel.act_mul(gate_up, s.activation)
            if act is None:  # an activation the C file does not compute as torch does here
                gate, up = gate_up.chunk(2, dim=-1)
                act = decoder.act(gate).mul_(up)
            mlp = decoder._linear(li, "down", act)
        following = decoder.norm if li + 1 == len(decoder.layers) else decoder.layers[li + 1]["input_layernorm"]
        h = ops.add_rms_norm(x, mlp, layer["post_feedforward_layernorm"] if sandwich else None, following, eps,
                             offset)
    return h
