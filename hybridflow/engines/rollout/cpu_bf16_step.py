"""An eager bf16 decode step on CPU in fewer ops: NativeDecoder._layers with its small ops as C calls.

Why: the fp32 decode step is one C call (cpu_decode_layer.py), but its driver calls fp32 kernels; in bf16 the
projections are calls of their own (bf16 tiles, cpu_bf16_linear.py, or oneDNN's packed product), and between them the
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

Where the projections run on the bf16 tiles (AMX or AVX512-BF16), `step` runs all of that and the output head as one
C call (cpu_decode_layer.c's decode_step_bf16, calling the same kernels through their function pointers), without the
Python-level work between the calls above (argument checks, allocations, ctypes conversions) at every layer; a routed
layer's routing is the router's product on those tiles and one C call with torch's softmax and top-k bits
(cpu_moe_router.py), or, where that does not run, torch's router called back from C. Elsewhere `layers` runs. Where
the steps are one call each, `loop` runs the generate call's decode loop in C as well (choosing, recording and
stopping between the steps, as the fp32 loop of cpu_decode_layer.py).

Exactness: each C call computes what the ops it replaces compute, bit for bit (torch's bf16 add; the step-op kernels'
norm and rotation; the gate checked against torch's per width and thread count, else torch's ops run), so tokens and
log-probs are the op-by-op step's (tests/engines/test_cpu_decode_layer.py). It applies to a CPU bf16 decoder whose
rollout engine set the step-op and decode-layer kernels (native_rollout.py), outside tensor parallelism.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from hybridflow.engines.rollout import cpu_moe_router, cpu_sampling
from hybridflow.engines.rollout.cpu_attention import DecodeAttentionKernel
from hybridflow.engines.rollout.cpu_bf16_linear import KSTEP, MAX_ROWS
from hybridflow.engines.rollout.cpu_decode_layer import DecodeLoop, layer_structs
from hybridflow.engines.rollout.moe import route

__all__ = ["applies", "layers", "loop", "routed_experts", "step"]

_ptr, _long, _int, _float = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class _ModelBf16(ctypes.Structure):  # cpu_decode_layer.c's struct model_bf16
    _fields_ = [("linear", _ptr), ("rms", _ptr), ("add_rms", _ptr), ("heads", _ptr), ("attn", _ptr),
                ("hidden", _long), ("heads_n", _long), ("kv_heads", _long), ("head_dim", _long), ("inter", _long),
                ("eps", _float), ("scale", _float), ("softcap", _float), ("offset", _int), ("sandwich", _int),
                ("vact", _ptr), ("vact_width", _int), ("act", _int), ("act_fma", _int), ("router", _ptr)]


class _StepBf16(ctypes.Structure):  # struct step_bf16
    _fields_ = [("R", _long), ("lenA", _int), ("lenB", _int), ("threads", _int), ("positions", _ptr),
                ("prompt_index", _ptr)] + [(name, _ptr) for name in ("x", "h", "qkv", "q", "k", "v", "attn", "out",
                                                                      "gate_up", "act", "scratch", "route_weights",
                                                                      "route_experts")]


_ROUTER = ctypes.CFUNCTYPE(_int, _long)  # struct model_bf16's router


class _MoeBf16(ctypes.Structure):  # cpu_decode_layer.c's struct moe_bf16
    _fields_ = [("linear", _ptr), ("gate_up", _ptr), ("down", _ptr), ("experts", _long), ("k", _long),
                ("inter", _long), ("hidden", _long), ("act", _int), ("act_fma", _int), ("vact_width", _int),
                ("vact", _ptr), ("slot", _ptr), ("rows", _ptr), ("gate_up_out", _ptr), ("act_out", _ptr), ("y", _ptr),
                ("route", _ptr), ("router", _ptr), ("exp16", _ptr), ("normalize", _int), ("logits", _ptr),
                ("scratch", _ptr), ("route_weights", _ptr), ("route_experts", _ptr)]


class _RoutedState:
    """A decoder's routed-experts calls: work buffers for up to `rows` rows, and per MoE layer its struct over the
    packed experts of `packed` (the decoder's packed weights; rebuilt when a weight update re-packs them). With the C
    router (cpu_moe_router.py) each layer's struct routes its rows itself into that layer's own route buffers."""

    def __init__(self, decoder, rows: int):
        s, k = decoder.shape, decoder.shape.experts_per_token
        inter, hidden, slots = s.moe_intermediate_size, s.hidden_size, rows * k
        self.rows, self.packed, self.layers = rows, None, {}
        self.router = cpu_moe_router.load()
        self.buffers = {"slot": torch.empty(slots, dtype=torch.int64)} | {
            name: torch.empty(slots, width, dtype=torch.bfloat16)
            for name, width in (("rows", hidden), ("gate_up_out", 2 * inter), ("act_out", inter), ("y", hidden))}
        if self.router is not None:
            self.buffers |= {"logits": torch.empty(rows, s.num_experts, dtype=torch.bfloat16),
                             "scratch": torch.empty(self.router.scratch_bytes(s.num_experts), dtype=torch.uint8)}
        self.routes = {}  # layer -> (weights [rows, k] bf16, experts [rows, k] int64): its last routing in C

    def struct(self, decoder, li: int) -> _MoeBf16:
        packed = decoder.packed_weights()
        if packed is not self.packed:
            self.packed, self.layers = packed, {}
        if li not in self.layers:
            s, weights = decoder.shape, packed["layers"][li]
            experts = weights["experts"]
            gate_up = (_ptr * len(experts))(*(pair[0].tiles.data_ptr() for pair in experts))
            down = (_ptr * len(experts))(*(pair[1].tiles.data_ptr() for pair in experts))
            struct = _MoeBf16(linear=decoder.bf16_kernel.linear_address, gate_up=ctypes.addressof(gate_up),
                              down=ctypes.addressof(down), experts=len(experts), k=s.experts_per_token,
                              inter=s.moe_intermediate_size, hidden=s.hidden_size,
                              **{name: self.buffers[name].data_ptr()
                                 for name in ("slot", "rows", "gate_up_out", "act_out", "y")})
            if self.router is not None and _routes_in_c(decoder, li):
                routes = self.routes.setdefault(li, (
                    torch.empty(self.rows, s.experts_per_token, dtype=torch.bfloat16),
                    torch.empty(self.rows, s.experts_per_token, dtype=torch.int64)))
                struct.route, struct.router = self.router.address, weights["router"].tiles.data_ptr()
                struct.exp16, struct.normalize = self.router.exp, int(s.norm_topk_prob)
                struct.logits, struct.scratch = self.buffers["logits"].data_ptr(), self.buffers["scratch"].data_ptr()
                struct.route_weights, struct.route_experts = routes[0].data_ptr(), routes[1].data_ptr()
            struct.keep = (gate_up, down)  # the pointer arrays live as long as the struct
            self.layers[li] = struct
        return self.layers[li]

    def route(self, decoder, li: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer li's routing of h [R, hidden] as the C step routes it: (weights [R, k], experts [R, k])."""
        s = decoder.shape
        if self.router is None or not _routes_in_c(decoder, li):
            return route(h, decoder.layers[li]["router"], s.experts_per_token, s.norm_topk_prob)
        logits = decoder.bf16_kernel.linear(h, decoder.packed_weights()["layers"][li]["router"], None)
        return self.router.route(logits, s.experts_per_token, s.norm_topk_prob)


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> _RoutedState


def _routes_in_c(decoder, li: int) -> bool:
    """Whether routed layer li routes in C (cpu_moe_router.py): the kernel runs here, gives torch's bits for this
    router's shape, and the router is packed in bf16 tiles."""
    s, router = decoder.shape, cpu_moe_router.load()
    return (router is not None and "router" in decoder.packed_weights()["layers"][li]
            and router.agrees(s.num_experts, s.experts_per_token, s.norm_topk_prob, torch.bfloat16))


def _experts_gate(decoder, kernel, rows: int, threads: int) -> tuple[int, int, int, int] | None:
    """The experts' act_mul_bf16 arguments where their C call applies to `rows` rows (packed in bf16 tiles, at most
    MAX_ROWS rows, widths whole tiles of k, a gate the C file computes as torch does here); else None."""
    s = decoder.shape
    if decoder.matmul != "bf16_tiles" or rows > MAX_ROWS or s.hidden_size % KSTEP or s.moe_intermediate_size % KSTEP:
        return None
    return kernel.bf16_gate(s.activation, s.moe_intermediate_size, threads)


def _experts_struct(decoder, li: int, rows: int, gate: tuple[int, int, int, int]) -> _MoeBf16:
    """Routed layer li's struct moe_bf16 with work buffers for at least `rows` rows."""
    state = _states.get(decoder)
    if state is None or state.rows < rows:
        state = _states[decoder] = _RoutedState(decoder, rows)
    struct = state.struct(decoder, li)
    struct.act, struct.act_fma, struct.vact, struct.vact_width = gate
    return struct


def routed_experts(decoder, li: int, h: torch.Tensor, kernel) -> torch.Tensor | None:
    """Routed-experts layer li's MLP output [R, hidden] for the MLP norm's output h [R, hidden] (bf16, contiguous):
    the routing as the one-call step routes (`_RoutedState.route`; recorded for routing replay), then the experts
    and their weighted sum as one C call (cpu_decode_layer.c's moe_experts_bf16) on the experts' bf16 tiles, the bits
    of moe.py's dispatch on the same kernels. None where it does not apply (`_experts_gate`) and the caller runs the
    decoder's own MLP."""
    s, rows, threads = decoder.shape, h.shape[0], torch.get_num_threads()
    gate = _experts_gate(decoder, kernel, rows, threads)
    if gate is None:
        return None
    struct = _experts_struct(decoder, li, rows, gate)
    weights, experts = _states[decoder].route(decoder, li, h)
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


class _OneCall:
    """A decoder's decode_step_bf16 arguments: the model struct (its kernels and shape), the layer structs on one cache
    (valid while its packed weights and that cache are the same objects) and the step's work buffers for R rows."""

    def __init__(self, decoder, gate: tuple[int, int, int, int], experts_gate: tuple[int, int, int, int] | None):
        s, ops = decoder.shape, decoder.step_ops
        self.model = _ModelBf16(
            linear=decoder.bf16_kernel.linear_address, rms=ops.addresses["rms_norm_bf16"],
            add_rms=ops.addresses["add_rms_norm_bf16"], heads=ops.addresses["qkv_heads_bf16"],
            attn=decoder.attention_kernel.addresses[torch.bfloat16], hidden=s.hidden_size, heads_n=s.num_heads,
            kv_heads=s.num_kv_heads, head_dim=s.head_dim, inter=s.intermediate_size, eps=s.rms_norm_eps,
            scale=s.attention_scale, softcap=s.attn_softcap or 0.0, offset=int(decoder.offset_norm),
            sandwich=int(bool(decoder.spec.sandwich_norms)))
        self.model.act, self.model.act_fma, self.model.vact, self.model.vact_width = gate
        self.experts_gate, self.routed = experts_gate, [li for li, layer in enumerate(s.layers) if layer.moe]
        self.tiles = self.cache = None  # weak references to what the layer structs point into
        self.layers, self.step, self.shape = None, None, None
        self.decoder, self.error = weakref.ref(decoder), None
        self.router = _ROUTER(self._route)  # kept: C holds its address
        self.model.router = ctypes.cast(self.router, _ptr).value

    def _route(self, li: int) -> int:
        """Called back from the step: routed layer li's router on the step's h (moe.route, torch's softmax and top-k,
        recorded for routing replay as `routed_experts` records it) into route_weights / route_experts."""
        try:
            decoder, buffers = self.decoder(), self.step.buffers
            s = decoder.shape
            weights, experts = route(buffers["h"], decoder.layers[li]["router"], s.experts_per_token,
                                     s.norm_topk_prob)
            if decoder.route_log is not None:
                decoder.route_log.append(experts)
            buffers["route_weights"].copy_(weights)
            buffers["route_experts"].copy_(experts)
            return 0
        except BaseException as error:  # raised again by `step` once the C call has returned
            self.error = error
            return -1

    def layer_structs(self, decoder, cache) -> ctypes.Array:
        packed = decoder.packed_weights()
        first = packed["layers"][0]["qkv"].tiles
        if self.tiles is None or self.tiles() is not first or self.cache() is not cache:
            self.layers = layer_structs(decoder, packed, cache, lambda w: None if w is None else w.tiles.data_ptr())
            self.tiles, self.cache = weakref.ref(first), weakref.ref(cache)
        return self.layers

    def work(self, decoder, rows: int, threads: int, keys: int) -> _StepBf16:
        """The step struct for `rows` rows at `threads` threads attending `keys` keys (kept while those fit)."""
        if self.shape is None or self.shape[0] != (rows, threads) or self.shape[1] < keys:
            s = decoder.shape
            H, KV, D, capacity = s.num_heads, s.num_kv_heads, s.head_dim, -(-keys // 256) * 256
            widths = {"x": s.hidden_size, "h": s.hidden_size, "qkv": (H + 2 * KV) * D, "q": H * D, "k": KV * D,
                      "v": KV * D, "attn": H * D, "out": s.hidden_size, "gate_up": 2 * s.intermediate_size,
                      "act": s.intermediate_size}
            buffers = {name: torch.empty(rows, width, dtype=torch.bfloat16) for name, width in widths.items()}
            buffers["scratch"] = DecodeAttentionKernel.scratch(threads, H // KV, D, capacity)
            if self.routed:
                buffers["route_weights"] = torch.empty(rows, s.experts_per_token, dtype=torch.bfloat16)
                buffers["route_experts"] = torch.empty(rows, s.experts_per_token, dtype=torch.int64)
            self.step = _StepBf16(R=rows, threads=threads, **{name: t.data_ptr() for name, t in buffers.items()})
            self.step.buffers = buffers  # the struct holds their addresses: kept alive with it
            self.shape = ((rows, threads), capacity)
        return self.step


# decoder -> (threads and the kernels asked, _OneCall or None)
_one_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _prepared(decoder, kernel, threads: int) -> _OneCall | None:
    """The decoder's _OneCall at `threads` threads, or None where a step cannot be one call (asked once per thread
    count and kernels): projections not on bf16 tiles, widths not whole tiles of k, tensors not in bf16, rotary tables
    not read in place, a gate the C file does not compute as torch does here (the dense MLP's or the experts')."""
    kernels = (kernel, decoder.attention_kernel, decoder.step_ops, decoder.rope)
    memo = _one_calls.get(decoder)
    if (memo is not None and memo[0][:2] == (threads, decoder.matmul)
            and all(a is b for a, b in zip(memo[0][2:], kernels))):
        return memo[1]
    s, ops, rope = decoder.shape, decoder.step_ops, decoder.rope
    tensors = [t for layer in decoder.layers for name, t in layer.items()
               if t is not None and (name.endswith("norm") or name.startswith("b_"))] + [decoder.norm]
    experts_gate = _experts_gate(decoder, kernel, 1, threads) if s.moe else None
    dense = not all(layer.moe for layer in s.layers)
    gate = kernel.bf16_gate(s.activation, s.intermediate_size, threads) if dense else experts_gate
    widths = (s.hidden_size, s.num_heads * s.head_dim) + ((s.intermediate_size,) if dense else ())
    fits = (decoder.matmul == "bf16_tiles" and gate is not None and (experts_gate is not None or not s.moe)
            and decoder.embed.is_contiguous()
            and isinstance(decoder.attention_kernel, DecodeAttentionKernel)
            and all(width % KSTEP == 0 for width in widths)
            and all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
            and ops.reads_tables(rope) and all(t.dtype == torch.bfloat16 for t in rope.cos.values())
            and decoder.packed_weights()["lm_head"].in_features == s.hidden_size)
    prepared = _OneCall(decoder, gate, experts_gate) if fits else None
    _one_calls[decoder] = ((threads, decoder.matmul, *kernels), prepared)
    return prepared


def step(decoder, tokens: torch.Tensor, positions: torch.Tensor, cache, rows, starts: dict, length: int,
         kernel) -> torch.Tensor | None:
    """A whole bf16 decode step as one C call (cpu_decode_layer.c's decode_step_bf16): fp32 logits [R, vocab] for
    tokens [R] at positions [R], what `layers` and NativeDecoder._head give, bit for bit (the same kernels on the same
    arguments in the same order). cache, rows, starts (first attended column per window) and length as
    NativeDecoder.decode's attention kernel takes them; the K/V of generated token ``length - 1`` are written. None
    where it does not apply (`_prepared`; more than MAX_ROWS rows, a cache not in bf16) and the caller runs `layers`."""
    R, threads = tokens.shape[0], torch.get_num_threads()
    prepared = _prepared(decoder, kernel, threads)
    if prepared is None or R > MAX_ROWS or cache.keys[0].dtype != torch.bfloat16:
        return None
    s = decoder.shape
    lenA, lenB = DecodeAttentionKernel.lengths(cache, length)
    work = prepared.work(decoder, R, threads, lenA + lenB)
    layers = prepared.layer_structs(decoder, cache)
    routed = {li: _experts_struct(decoder, li, R, prepared.experts_gate) for li in prepared.routed}
    for li, struct in routed.items():  # work buffers for this step's rows
        layers[li].moe = ctypes.addressof(struct)
    x = work.buffers["x"].copy_(decoder._embed(tokens))  # the residual stream, as `layers` starts it
    if decoder.embed_scale is not None:
        x.mul_(decoder.embed_scale)
    prompt_index = rows.prompt_index.to(torch.int64).contiguous() if cache.shared else None
    positions = positions.to(torch.int64).contiguous()
    per_window = {window: start.to(torch.int32).contiguous() for window, start in starts.items()}
    starts_p = (_ptr * len(layers))(*(per_window[s.layers[li].window].data_ptr() for li in range(len(layers))))
    work.lenA, work.lenB, work.positions = lenA, lenB, positions.data_ptr()
    work.prompt_index = None if prompt_index is None else prompt_index.data_ptr()
    head = decoder.packed_weights()["lm_head"]
    logits = torch.empty(R, head.out_features, dtype=torch.bfloat16)
    failed = kernel.decode_step_bf16(ctypes.addressof(prepared.model), ctypes.addressof(layers), len(layers),
                                     ctypes.addressof(work), starts_p, decoder.norm.data_ptr(), head.tiles.data_ptr(),
                                     head.out_features, logits.data_ptr())
    if failed == -2:
        error, prepared.error = prepared.error, None
        raise error
    if failed == -3:
        raise IndexError(f"native rollout: a router chose experts outside its {s.num_experts}")
    if failed:  # nothing computed
        return None
    if decoder.route_log is not None:  # the routes chosen in C, layer by layer (the called-back router records its own)
        state = _states[decoder]
        decoder.route_log.extend(state.routes[li][1][:R].clone() for li, struct in routed.items() if struct.route)
    logits = logits.float()
    cap = s.final_softcap
    if cap is not None:  # Gemma 2, as NativeDecoder._head: cap * tanh(logits / cap)
        logits = torch.tanh(logits / cap) * cap
    return logits


class _Bf16Loop(DecodeLoop):
    """cpu_decode_layer.DecodeLoop with `step`'s one-call bf16 steps (cpu_decode_layer.c's decode_loop_bf16): the
    same choosing, recording and stopping, each step's embeddings, layers and head as `step` computes them."""

    def _bind(self, R: int, threads: int):
        decoder, kernel = self.decoder, self.kernel
        prepared = _prepared(decoder, kernel, threads)
        work = prepared.work(decoder, R, threads, self.keys)
        layers = prepared.layer_structs(decoder, self.cache)
        for li in prepared.routed:  # work buffers for R rows
            layers[li].moe = ctypes.addressof(_experts_struct(decoder, li, R, prepared.experts_gate))
        head = decoder.packed_weights()["lm_head"]
        step_logits = torch.empty(R, head.out_features, dtype=torch.bfloat16)
        scale = 0.0 if decoder.embed_scale is None else float(decoder.embed_scale)
        args = (ctypes.addressof(prepared.model), ctypes.addressof(layers), len(layers), ctypes.addressof(work))
        rest = (decoder.embed.data_ptr(), decoder.embed.shape[0], scale, decoder.norm.data_ptr(),
                head.tiles.data_ptr())

        def call(state: int, step: int, logits: int) -> int:
            return kernel.loop_bf16(*args, state, step, logits, *rest)

        return head.out_features, call, work, {"step_logits": step_logits, "layers": layers}


def loop(decoder, cache, prompt_bias: torch.Tensor, kernel, *, greedy: bool, temperature: float, top_k: int,
         top_p: float, stop_ids: torch.Tensor, max_new: int, compact_fraction: float) -> DecodeLoop | None:
    """A generate call's bf16 decode loop in C (cpu_decode_layer.DecodeLoop's contract) for `decoder` on `cache`, rows
    with prompt masks prompt_bias [R, P]; None where it does not apply: where a step is not `step`'s one C call (see
    `_prepared`; more than MAX_ROWS rows), a routed layer would call torch's router back, the logits are soft-capped
    (Gemma 2: in torch after the step), the attention kernel does not read this cache or a prompt mask is not left
    padding, or the sampling kernel did not build."""
    if (not hasattr(kernel, "act_mul") or decoder.dtype != torch.bfloat16 or decoder.device.type != "cpu"
            or not hasattr(decoder.step_ops, "add_rms_norm")):
        return None
    threads, sampler = torch.get_num_threads(), cpu_sampling.load()
    prepared = _prepared(decoder, kernel, threads)
    attention = decoder.attention_kernel
    if (prepared is None or sampler is None or prompt_bias.shape[0] > MAX_ROWS or decoder.shape.final_softcap
            or cache.keys[0].dtype != torch.bfloat16 or not attention.supports(cache)
            or attention.starts(prompt_bias, cache.prompt_len, 1, (None,)) is None
            or any(not _routes_in_c(decoder, li) for li in prepared.routed)):
        return None
    return _Bf16Loop(kernel, decoder, cache, sampler, greedy=greedy, temperature=temperature, top_k=top_k,
                     top_p=top_p, stop_ids=stop_ids, max_new=max_new, compact_fraction=compact_fraction)
