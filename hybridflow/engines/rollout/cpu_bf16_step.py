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
    act_mul        the MLP's gate, act(gate) * up (cpu_decode_layer.py); on a routed-experts layer, after the router
                   (torch's), the experts, their gates and the weighted sum as one call instead (`routed_experts`)
    add_rms_norm   the MLP's residual add and the next layer's input norm, or the final norm after the last layer

Exactness: each C call computes what the ops it replaces compute, bit for bit (torch's bf16 add; the step-op kernels'
norm and rotation; the gate checked against torch's per width and thread count, else torch's ops run), so tokens and
log-probs are the op-by-op step's (tests/engines/test_cpu_decode_layer.py). It applies to a CPU bf16 decoder whose
rollout engine set the step-op and decode-layer kernels (native_rollout.py), outside tensor parallelism.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from hybridflow.engines.rollout.cpu_amx_linear import KSTEP, MAX_ROWS
from hybridflow.engines.rollout.moe import route

__all__ = ["applies", "layers", "routed_experts"]

_ptr, _long, _int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


class _MoeBf16(ctypes.Structure):  # cpu_decode_layer.c's struct moe_bf16
    _fields_ = [("linear", _ptr), ("gate_up", _ptr), ("down", _ptr), ("experts", _long), ("k", _long),
                ("inter", _long), ("hidden", _long), ("act", _int), ("act_fma", _int), ("vact_width", _int),
                ("vact", _ptr), ("slot", _ptr), ("rows", _ptr), ("gate_up_out", _ptr), ("act_out", _ptr), ("y", _ptr)]


class _RoutedState:
    """A decoder's routed-experts calls: work buffers for up to `rows` rows, and per MoE layer its struct over the
    packed experts of `packed` (the decoder's packed weights; rebuilt when a weight update re-packs them)."""

    def __init__(self, decoder, rows: int):
        s, k = decoder.shape, decoder.shape.experts_per_token
        inter, hidden, slots = s.moe_intermediate_size, s.hidden_size, rows * k
        self.rows, self.packed, self.layers = rows, None, {}
        self.buffers = {"slot": torch.empty(slots, dtype=torch.int64)} | {
            name: torch.empty(slots, width, dtype=torch.bfloat16)
            for name, width in (("rows", hidden), ("gate_up_out", 2 * inter), ("act_out", inter), ("y", hidden))}

    def struct(self, decoder, li: int) -> _MoeBf16:
        packed = decoder.packed_weights()
        if packed is not self.packed:
            self.packed, self.layers = packed, {}
        if li not in self.layers:
            s, experts = decoder.shape, packed["layers"][li]["experts"]
            gate_up = (_ptr * len(experts))(*(pair[0].tiles.data_ptr() for pair in experts))
            down = (_ptr * len(experts))(*(pair[1].tiles.data_ptr() for pair in experts))
            struct = _MoeBf16(linear=decoder.amx_kernel.linear_address, gate_up=ctypes.addressof(gate_up),
                              down=ctypes.addressof(down), experts=len(experts), k=s.experts_per_token,
                              inter=s.moe_intermediate_size, hidden=s.hidden_size,
                              **{name: t.data_ptr() for name, t in self.buffers.items()})
            struct.keep = (gate_up, down)  # the pointer arrays live as long as the struct
            self.layers[li] = struct
        return self.layers[li]


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> _RoutedState


def routed_experts(decoder, li: int, h: torch.Tensor, kernel) -> torch.Tensor | None:
    """Routed-experts layer li's MLP output [R, hidden] for the MLP norm's output h [R, hidden] (bf16, contiguous):
    the router in torch (moe.route, recorded for routing replay), then the experts and their weighted sum as one C call
    (cpu_decode_layer.c's moe_experts_bf16) on the experts' AMX tiles, the bits of moe.py's dispatch on the same
    kernels. None where it does not apply (not AMX-packed, more than MAX_ROWS rows, widths not whole tiles of k, a gate
    the C file does not compute as torch does here) and the caller runs the decoder's own MLP."""
    s, rows, threads = decoder.shape, h.shape[0], torch.get_num_threads()
    inter = s.moe_intermediate_size
    if decoder.matmul != "amx" or rows > MAX_ROWS or s.hidden_size % KSTEP or inter % KSTEP:
        return None
    gate = kernel.bf16_gate(s.activation, inter, threads)
    if gate is None:
        return None
    state = _states.get(decoder)
    if state is None or state.rows < rows:
        state = _states[decoder] = _RoutedState(decoder, rows)
    struct = state.struct(decoder, li)
    struct.act, struct.act_fma, struct.vact, struct.vact_width = gate
    weights, experts = route(h, decoder.layers[li]["router"], s.experts_per_token, s.norm_topk_prob)
    if decoder.route_log is not None:
        decoder.route_log.append(experts)
    weights, experts = weights.contiguous(), experts.to(torch.int64).contiguous()
    out = torch.empty_like(h)
    if kernel.moe_experts_bf16(ctypes.addressof(struct), rows, h.data_ptr(), weights.data_ptr(), experts.data_ptr(),
                               out.data_ptr(), threads) != 0:
        raise IndexError(f"native rollout: layer {li}'s router chose experts {experts.unique().tolist()}, outside its "
                         f"{s.num_experts}")
    return out


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
            mlp = routed_experts(decoder, li, h, kernel)
            if mlp is None:
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
