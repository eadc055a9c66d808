"""An fp32 decode step on CPU as one C call, or its layers as two C calls each (cpu_decode_layer.c), built on first use.

Why: with its projections, attention, norms and rotary embedding each one C call, an eager fp32 decode step still ran
a dozen Python-level operations a layer (norm, projection, slicing and views, rotation, attention with its argument
checks, residual adds, gate/up split), each with its dispatch and allocation: at 16 rows of the ~21M "mid" model a
quarter of a generate call's wall time was outside the C kernels, and most of the tiny model's
(``benchmarks/rollout_profile.py``'s ``kernel_seconds``). ``step`` runs the whole decode step as one call: the token
embeddings, every layer with the MLP's gate in C, the final norm and the output head; that needs the gate (SiLU or
GELU's tanh form) to give torch's bits here, checked against torch per MLP width and thread count
(`activation_variant`). Where it does not, ``layers`` runs each layer as two calls, the first from its input norm
through the attention block and the residual to the gate/up projection, the second the down projection and its
residual, with torch's ``act(gate) * up`` between them. A routed-experts (MoE) model's steps run `layers` too: on a
routed layer the router runs in torch after the first call (its softmax is torch's own), and the experts, their
gate, the weighted sum and the residual are the second (``layer_moe_out_f32``), grouped by expert as moe.py's
dispatch groups them.

``DecodeLoop`` goes one level up: where the steps are one call each, a generate call's loop (choose each row's
token, record it, check the stop tokens, decode the next step) runs in C too, returning to native_rollout.py only to
drop stopped rows, for the next table of draws, or at the end.

Exactness: the C driver calls the same kernels as the eager step (through their function pointers) with the same
arguments in the same order; a residual is one fp32 add per element either way. So tokens and log-probs are the same
bits as without it (tests/engines/test_cpu_decode_layer.py).

It applies to a decoder whose projections run on the panel kernel (fp32, ``matmul == "panel"``), whose decode
attention runs on cpu_attention.py's kernel, whose fp32 norm and rotary embedding run on cpu_step_ops.py's kernels,
outside tensor parallelism; elsewhere the eager step runs as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridflow.engines.rollout import cpu_moe_router, cpu_sampling
from hybridflow.engines.rollout.c_kernels import load_library, torch_vector_function
from hybridflow.engines.rollout.cpu_attention import DecodeAttentionKernel
from hybridflow.engines.rollout.cpu_linear import PanelLinearKernel, PanelWeight
from hybridflow.engines.rollout.cpu_step_ops import StepOpsKernel
from hybridflow.engines.rollout.moe import route
from hybridflow.engines.rollout.sampling import NOT_A_DISTRIBUTION

__all__ = ["DecodeLayerKernel", "DecodeLoop", "layer_structs", "load"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode_layer.c")
_ptr, _long, _int, _float = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class _Model(ctypes.Structure):
    _fields_ = [("panel", _ptr), ("rms", _ptr), ("rope", _ptr), ("attn", _ptr),
                ("hidden", _long), ("heads", _long), ("kv_heads", _long), ("head_dim", _long), ("inter", _long),
                ("eps", _float), ("scale", _float), ("softcap", _float), ("lanes", _int), ("sandwich", _int),
                ("vact", _ptr), ("vact_width", _int), ("act", _int), ("act_fma", _int)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm",
                                          "k_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias",
                                          "down", "down_bias", "cos", "ssin")] + [
        ("rotary_dim", _long), ("kA", _ptr), ("vA", _ptr), ("kAr", _long), ("kAh", _long), ("kAd", _long),
        ("vAr", _long), ("vAh", _long), ("kB", _ptr), ("vB", _ptr), ("kBr", _long), ("kBh", _long), ("kBd", _long),
        ("vBr", _long), ("vBh", _long), ("moe", _ptr)]


class _MoeLayer(ctypes.Structure):
    _fields_ = [("gate_up", _ptr), ("down", _ptr)]


class _MoeStep(ctypes.Structure):
    _fields_ = [("experts", _long), ("k", _long), ("inter", _long), ("act", _int), ("act_fma", _int)] + [
        (name, _ptr) for name in ("token", "weight", "rows", "gate_up", "act_out", "y", "sum")]


class _Loop(ctypes.Structure):
    _fields_ = [("sample", _ptr), ("filtered", _ptr), ("top_k", _long), ("top_p", ctypes.c_double), ("vocab", _long),
                ("temperature", _float), ("greedy", _int), ("uniforms", _ptr),
                ("uniforms_first", _long), ("uniforms_end", _long), ("max_new", _long), ("stop_ids", _ptr),
                ("n_stop", _long), ("compact_fraction", ctypes.c_double)] + [
        (name, _ptr) for name in ("out_tokens", "out_log_probs", "out_lengths", "row_index", "done")] + [
        ("n_done", _long)] + [(name, _ptr) for name in ("tokens", "log_probs", "sums", "logits", "positions", "pads",
                                                        "windows", "starts")] + [
        ("prompt_len", _long), ("offset", _long), ("shared", _int), ("step", _long), ("step_logits", _ptr)]


class _Step(ctypes.Structure):
    _fields_ = [("R", _long), ("lenA", _int), ("lenB", _int), ("threads", _int), ("positions", _ptr),
                ("prompt_index", _ptr)] + [(name, _ptr) for name in ("x", "h", "qkv", "qn", "kn", "q", "k", "v",
                                                                      "attn", "gate_up", "tmp", "scratch", "act")]


@functools.cache
def load() -> DecodeLayerKernel | None:
    """The driver, built on first use (c_kernels.py); None where it cannot be built here."""
    lib = load_library(_SOURCE, "decode_layer", "decode-layer", "the decode steps call the kernels one by one",
                       fast_math=False, extra_flags=("-ffp-contract=off",))
    return None if lib is None else DecodeLayerKernel(lib)


def _data(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _panels(weight: PanelWeight | None) -> int | None:
    return None if weight is None else weight.panels.data_ptr()


# the activations the C file computes as torch does: config name -> (its enum, the vector function torch's kernel calls)
_ACTIVATIONS = {"silu": (0, "exp"), "gelu_pytorch_tanh": (1, "tanh")}


class DecodeLayerKernel:
    """``applies(decoder)``: whether a decoder's eager steps can use it; ``layers(decoder, x, ...)``: its layers."""

    def __init__(self, lib: ctypes.CDLL):
        self._attention, self._mlp_out = lib.layer_attention_f32, lib.layer_mlp_out_f32
        for function in (self._attention, self._mlp_out):
            function.argtypes = [_ptr, _ptr, _ptr, _ptr]
            function.restype = None
        self._act = lib.act_mul_f32
        self._act.argtypes = [_int, _int, _ptr, _int, _ptr, _long, _long, _ptr, _int]
        self._act.restype = _int
        self._act_bf16 = lib.act_mul_bf16
        self._act_bf16.argtypes = self._act.argtypes
        self._act_bf16.restype = _int
        self._decode_step = lib.decode_step_f32
        self._decode_step.argtypes = [_ptr, _ptr, _long, _ptr, _ptr, _ptr, _ptr, _long, _float, _ptr, _ptr, _long,
                                      _ptr]
        self._decode_step.restype = _int
        self._loop = lib.decode_loop_f32
        self._loop.argtypes = [_ptr, _ptr, _long, _ptr, _ptr, _long, _ptr, _ptr, _long, _float, _ptr, _ptr]
        self._loop.restype = _long
        self.loop_bf16 = lib.decode_loop_bf16  # the same arguments with bf16 structs (cpu_bf16_step.py's loop)
        self.loop_bf16.argtypes = self._loop.argtypes
        self.loop_bf16.restype = _long
        self._moe_out = lib.layer_moe_out_f32
        self._moe_out.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr]
        self._moe_out.restype = _int
        # the bf16 step's C calls (cpu_bf16_step.py): its routed experts (struct moe_bf16, R, h, weights, experts,
        # out, threads) and the whole step (struct model_bf16, layers, n_layers, struct step_bf16, starts,
        # final_norm, head, vocab, logits)
        self.moe_experts_bf16 = lib.moe_experts_bf16
        self.moe_experts_bf16.argtypes = [_ptr, _long, _ptr, _ptr, _ptr, _ptr, _int]
        self.moe_experts_bf16.restype = _int
        self.decode_step_bf16 = lib.decode_step_bf16
        self.decode_step_bf16.argtypes = [_ptr, _ptr, _long, _ptr, _ptr, _ptr, _ptr, _long, _ptr]
        self.decode_step_bf16.restype = _int
        # (activation, MLP width, threads, dtype) -> activation_variant
        self._act_checked: dict[tuple[str, int, int, torch.dtype], int | None] = {}
        # decoder -> (what `applies` read, its answer): asked every decode step
        self._applies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # decoder -> (weak references to its first packed weight and to the cache, model struct, layer structs): the
        # structs hold raw addresses, valid while those objects live (a weight update re-packs, a generate call
        # allocates its cache); all weak, so that the memo keeps none of them alive
        self._memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # decoder -> ((rows, threads), scratch keys, step struct, gate, up, routed-experts step struct or None): the
        # work buffers of its last decode step
        self._steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def applies(decoder) -> bool:
        """Whether `decoder`'s (native_model.NativeDecoder, not a tensor-parallel rank's: the engine does not give
        those this kernel) eager decode steps can run their layers here: panel projections, the attention kernel,
        the fp32 norm and rotary kernels on the rotary tables in place; routed-experts layers only without sandwich
        norms (no such architecture has both)."""
        s, ops = decoder.shape, decoder.step_ops
        return (decoder.matmul == "panel" and decoder.dtype == torch.float32
                and isinstance(decoder.panel_kernel, PanelLinearKernel)
                and isinstance(decoder.attention_kernel, DecodeAttentionKernel)  # not a replaced call (benchmarks)
                and isinstance(ops, StepOpsKernel) and ops.f32_lanes is not None
                and not (s.moe and decoder.spec.sandwich_norms)
                and ops.reads_tables(decoder.rope) and all(t.dtype == torch.float32 for t in decoder.rope.cos.values())
                and max(s.hidden_size, s.head_dim) < 32768)  # cpu_step_ops' limit for the fp32 norm

    def applies_to(self, decoder) -> bool:
        """`applies(decoder)`, kept while the decoder's kernels, rotary tables, matmul and dtype are the same
        objects."""
        key = (decoder.matmul, decoder.dtype, decoder.panel_kernel, decoder.attention_kernel, decoder.step_ops,
               decoder.rope)
        memo = self._applies.get(decoder)
        if memo is None or any(a is not b for a, b in zip(memo[0], key)):
            memo = (key, self.applies(decoder))
            self._applies[decoder] = memo
        return memo[1]

    def activation_variant(self, activation: str, inter: int, threads: int,
                           dtype: torch.dtype = torch.float32) -> int | None:
        """How act_mul_f32 (act_mul_bf16 for dtype bf16) gives torch's ``act(gate).mul_(up)`` bit for bit for
        `activation` (a config name) on an MLP of width `inter` at `threads` threads: its `fma` flag (whether torch's
        build fused GELU's x + kappa x^3), or None where neither way does (or the activation is not one it computes).
        Tried once per key, on row counts that split rows between torch's threads and leave odd runs."""
        key = (activation, inter, threads, dtype)
        if key not in self._act_checked:
            self._act_checked[key] = next((fma for fma in (1, 0) if self._try_activation(activation, fma, inter,
                                                                                          threads, dtype)), None)
            if self._act_checked[key] is None and activation in _ACTIVATIONS:
                logger.info("native rollout: the C %s differs from torch's here (MLP width %d, %d threads, %s), so the "
                            "decode steps keep torch's activation", activation, inter, threads, dtype)
        return self._act_checked[key]

    def _try_activation(self, activation: str, fma: int, inter: int, threads: int, dtype: torch.dtype) -> bool:
        if activation not in _ACTIVATIONS:
            return False
        kind, name = _ACTIVATIONS[activation]
        vector = torch_vector_function(name)
        if vector is None:
            return False
        function = self._act_bf16 if dtype == torch.bfloat16 else self._act
        torch_act = F.silu if kind == 0 else functools.partial(F.gelu, approximate="tanh")
        g = torch.Generator().manual_seed(0)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for rows in (1, 3, 16, 33, 64, 127):
                gate_up = (torch.randn(rows, 2 * inter, generator=g) * torch.tensor([0.5, 4.0, 30.0])[
                    torch.randint(3, (rows, 2 * inter), generator=g)]).to(dtype)
                want = torch_act(gate_up[:, :inter]).mul_(gate_up[:, inter:])
                got = torch.empty(rows, inter, dtype=dtype)
                if function(kind, fma, vector[0], vector[1], gate_up.data_ptr(), rows, inter, got.data_ptr(),
                            threads) != 0 or not torch.equal(got, want):
                    return False
        finally:
            torch.set_num_threads(before)
        return True

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor | None:
        """``act(gate).mul_(up)`` [R, inter] for a bf16 decode step's gate_up [R, 2 inter] (contiguous, on CPU) as one
        C call, torch's bits (`activation_variant`); None where the C file does not compute it as torch does here."""
        R, inter = gate_up.shape[0], gate_up.shape[1] // 2
        threads = torch.get_num_threads()
        if gate_up.dtype != torch.bfloat16 or not gate_up.is_contiguous() or gate_up.dim() != 2:
            return None
        gate = self.bf16_gate(activation, inter, threads)
        if gate is None:
            return None
        out = torch.empty(R, inter, dtype=torch.bfloat16)
        self._act_bf16(*gate, gate_up.data_ptr(), R, inter, out.data_ptr(), threads)
        return out

    def bf16_gate(self, activation: str, inter: int, threads: int) -> tuple[int, int, int, int] | None:
        """act_mul_bf16's first arguments (activation, fma, vector function, its width) for torch's bits on an MLP of
        width `inter` at `threads` threads; None where it does not give them (`activation_variant`)."""
        fma = self.activation_variant(activation, inter, threads, torch.bfloat16)
        if fma is None:
            return None
        return _ACTIVATIONS[activation][0], fma, *torch_vector_function(_ACTIVATIONS[activation][1])

    def step(self, decoder, tokens: torch.Tensor, positions: torch.Tensor, cache, rows, starts: dict,
             length: int) -> torch.Tensor | None:
        """A whole decode step as one C call: logits [R, vocab] fp32 for tokens [R] at positions [R] (cache, rows,
        starts, length as in `layers`); None where it does not apply (an activation the C file does not compute as
        torch does here, a head not packed for the panel kernel), and the caller runs `layers`."""
        s = decoder.shape
        threads = torch.get_num_threads()
        prepared = self._one_call(decoder, cache, threads)
        if prepared is None:
            return None
        model, layers, head = prepared
        lenA, lenB = DecodeAttentionKernel.lengths(cache, length)
        prompt_index = rows.prompt_index.to(torch.int64).contiguous() if cache.shared else None
        positions = positions.to(torch.int64).contiguous()
        tokens = tokens.to(torch.int64).contiguous()
        per_window = {window: start.to(torch.int32).contiguous() for window, start in starts.items()}
        starts_p = (ctypes.c_void_p * len(layers))(*(per_window[s.layers[li].window].data_ptr()
                                                     for li in range(len(layers))))
        step, *_ = self._step(decoder, tokens.shape[0], threads, lenA + lenB)
        x = torch.empty(tokens.shape[0], s.hidden_size)
        step.lenA, step.lenB, step.positions, step.x = lenA, lenB, positions.data_ptr(), x.data_ptr()
        step.prompt_index = _data(prompt_index)
        logits = torch.empty(tokens.shape[0], head.out_features)
        scale = 0.0 if decoder.embed_scale is None else float(decoder.embed_scale)
        failed = self._decode_step(ctypes.addressof(model), ctypes.addressof(layers), len(layers),
                                   ctypes.addressof(step), starts_p, tokens.data_ptr(), decoder.embed.data_ptr(),
                                   decoder.embed.shape[0], scale, decoder.norm.data_ptr(), head.panels.data_ptr(),
                                   head.out_features, logits.data_ptr())
        if failed:
            bad = tokens[(tokens < 0) | (tokens >= decoder.embed.shape[0])]
            raise IndexError(f"native rollout: token ids {bad.tolist()[:8]} are outside the embedding's "
                             f"{decoder.embed.shape[0]} rows")
        cap = s.final_softcap
        if cap is not None:  # Gemma 2, as the eager step's _logits: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _one_call(self, decoder, cache, threads: int) -> tuple[_Model, ctypes.Array, PanelWeight] | None:
        """The model struct (its gate set), the layer structs and the packed head for a decode step as one call on
        `cache`; None where that does not apply (see `step`)."""
        s = decoder.shape
        if not decoder.embed.is_contiguous() or s.moe:  # the router runs in torch between a routed layer's calls
            return None
        fma = self.activation_variant(s.activation, s.intermediate_size, threads)
        head = decoder.packed_weights()["lm_head"]
        if fma is None or not isinstance(head, PanelWeight) or head.panels.shape[1] != s.hidden_size:
            return None
        model, layers, _ = self._structs(decoder, cache)
        kind, name = _ACTIVATIONS[s.activation]
        model.act, model.act_fma = kind, fma
        model.vact, model.vact_width = torch_vector_function(name)
        return model, layers, head

    def loop(self, decoder, cache, prompt_bias: torch.Tensor, *, greedy: bool, temperature: float, top_k: int,
             top_p: float, stop_ids: torch.Tensor, max_new: int, compact_fraction: float) -> DecodeLoop | None:
        """A generate call's decode loop in C (`DecodeLoop`) for `decoder` on `cache`, choosing tokens as
        cpu_sampling.SamplingKernel.choose does; None where it does not apply: where a step is not one C call
        (`step`), the attention kernel does not read this cache, a prompt mask is not left padding, the logits are
        soft-capped (Gemma 2: in torch after the step), or the sampling kernel did not build."""
        threads = torch.get_num_threads()
        attention = decoder.attention_kernel
        sampler = cpu_sampling.load()
        if (sampler is None or decoder.shape.final_softcap is not None or not self.applies_to(decoder)
                or not attention.supports(cache) or self._one_call(decoder, cache, threads) is None
                or attention.starts(prompt_bias, cache.prompt_len, 1, (None,)) is None):
            return None
        return DecodeLoop(self, decoder, cache, sampler, greedy=greedy, temperature=temperature, top_k=top_k,
                          top_p=top_p, stop_ids=stop_ids, max_new=max_new, compact_fraction=compact_fraction)

    def layers(self, decoder, x: torch.Tensor, positions: torch.Tensor, cache, rows, starts: dict,
               length: int) -> torch.Tensor:
        """Every layer of one decode step on the hidden states x [R, hidden] (fp32, contiguous; updated in place and
        returned) at positions [R]; cache, rows, starts and length as NativeDecoder.decode's attention kernel takes
        them (its K/V of generated token ``length - 1`` are written)."""
        s = decoder.shape
        model, layers, experts = self._structs(decoder, cache)
        threads = torch.get_num_threads()
        lenA, lenB = DecodeAttentionKernel.lengths(cache, length)
        prompt_index = rows.prompt_index.to(torch.int64).contiguous() if cache.shared else None
        positions = positions.to(torch.int64).contiguous()
        starts = {window: start.to(torch.int32).contiguous() for window, start in starts.items()}
        step, gate, up, moe = self._step(decoder, x.shape[0], threads, lenA + lenB)
        step.lenA, step.lenB, step.positions, step.x = lenA, lenB, positions.data_ptr(), x.data_ptr()
        step.prompt_index = _data(prompt_index)
        model_p, step_p = ctypes.addressof(model), ctypes.addressof(step)
        if moe is not None:  # the experts' gate in C where it is torch's for their width (as `step` checks it)
            fma = self.activation_variant(s.activation, s.moe_intermediate_size, threads)
            moe.act, moe.act_fma = (-1, 0) if fma is None else (_ACTIVATIONS[s.activation][0], fma)
            if fma is not None:
                model.vact, model.vact_width = torch_vector_function(_ACTIVATIONS[s.activation][1])
        for li, layer in enumerate(layers):
            start = starts[s.layers[li].window]
            self._attention(model_p, ctypes.addressof(layer), step_p, start.data_ptr())
            if s.layers[li].moe:
                self._routed(decoder, li, x, step, moe, experts[li], model_p, step_p)
                continue
            act = decoder.act(gate).mul_(up)  # torch's activation, as the eager step's _mlp
            if not act.is_contiguous():
                act = act.contiguous()
            self._mlp_out(model_p, ctypes.addressof(layer), step_p, act.data_ptr())
        return x

    def _routed(self, decoder, li: int, x: torch.Tensor, step: _Step, moe: _MoeStep, experts_struct: _MoeLayer,
                model_p: int, step_p: int) -> None:
        """Routed-experts layer li's MLP on the norm's output in the step's h buffer, added to x: the router's
        product in torch, its softmax and top-k as one C call where cpu_moe_router runs (moe.route's bits; recorded
        for routing replay as the eager step records it), the experts as one C call; moe.py's dispatch in torch where
        the C gate is not torch's for the experts' width."""
        s, h = decoder.shape, step.buffers["h"]
        router = cpu_moe_router.load()  # torch's softmax and top-k as one C call, their bits (cpu_moe_router.py)
        if router is None or not router.agrees(s.num_experts, s.experts_per_token, s.norm_topk_prob, h.dtype):
            weights, experts = route(h, decoder.layers[li]["router"], s.experts_per_token, s.norm_topk_prob)
        else:
            weights, experts = router.route(F.linear(h, decoder.layers[li]["router"]), s.experts_per_token,
                                            s.norm_topk_prob)
        if decoder.route_log is not None:
            decoder.route_log.append(experts)
        if moe.act < 0:
            x.add_(decoder.routed_experts(li, h, weights, experts))
            return
        weights, experts = weights.float().contiguous(), experts.to(torch.int64).contiguous()
        if self._moe_out(model_p, ctypes.addressof(experts_struct), step_p, ctypes.addressof(moe),
                         weights.data_ptr(), experts.data_ptr()) != 0:
            raise IndexError(f"native rollout: layer {li}'s router chose experts {experts.unique().tolist()}, "
                             f"outside its {s.num_experts}")

    def _step(self, decoder, R: int, threads: int,
              keys: int) -> tuple[_Step, torch.Tensor, torch.Tensor, _MoeStep | None]:
        """The step struct with its work buffers for R rows, `threads` threads and `keys` attended keys, the
        gate and up halves of its gate_up buffer, and a routed-experts model's experts step struct: kept between the steps of a decode loop (and calls) while R and
        the thread count stay and the attention's scratch is large enough; its per-step fields are set by the caller.
        A decode step of a small model otherwise spent more time allocating these than in some of its kernels."""
        memo = self._steps.get(decoder)
        if memo is not None and memo[0] == (R, threads) and memo[1] >= keys:
            return memo[2], memo[3], memo[4], memo[5]
        s, spec = decoder.shape, decoder.spec
        H, KV, D, inter = s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size
        capacity = -(-keys // 256) * 256  # the scratch grows with the keys: room for the next 256

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.float32)

        buffers = {"h": empty(R, s.hidden_size), "qkv": empty(R, (H + 2 * KV) * D), "q": empty(R, H * D),
                   "k": empty(R, KV * D), "v": empty(R, KV * D), "attn": empty(R, H * D),
                   "gate_up": empty(R, 2 * inter), "act": empty(R, inter),
                   "scratch": DecodeAttentionKernel.scratch(threads, H // KV, D, capacity)}
        if spec.qk_norm:
            buffers |= {"qn": empty(R, H * D), "kn": empty(R, KV * D)}
        if spec.sandwich_norms:
            buffers["tmp"] = empty(R, s.hidden_size)
        step = _Step(R=R, threads=threads, **{name: t.data_ptr() for name, t in buffers.items()})
        step.buffers = buffers  # the struct holds their addresses: kept alive with it
        gate, up = buffers["gate_up"][:, :inter], buffers["gate_up"][:, inter:]
        moe = None
        if s.moe:
            A, E, inter = R * s.experts_per_token, s.num_experts, s.moe_intermediate_size
            work = {"token": torch.empty(A, dtype=torch.int64), "weight": empty(A), "rows": empty(A, s.hidden_size),
                    "gate_up": empty(A, 2 * inter), "act_out": empty(A, inter), "y": empty(A, s.hidden_size),
                    "sum": empty(R, s.hidden_size)}
            moe = _MoeStep(experts=E, k=s.experts_per_token, inter=inter, **{n: t.data_ptr() for n, t in work.items()})
            moe.buffers = work
        self._steps[decoder] = ((R, threads), capacity, step, gate, up, moe)
        return step, gate, up, moe

    def _structs(self, decoder, cache) -> tuple[_Model, ctypes.Array, dict[int, _MoeLayer]]:
        """The decoder's model struct, per-layer structs for `cache` and its routed-experts layers' expert structs
        (by layer index), kept while its packed weights and the cache are the same objects (a weight update re-packs,
        a generate call allocates its cache)."""
        packed = decoder.packed_weights()
        first = packed["layers"][0]["qkv"].panels
        memo = self._memo.get(decoder)
        if memo is not None and memo[0]() is first and memo[1]() is cache:
            return memo[2], memo[3], memo[4]
        s, spec, ops = decoder.shape, decoder.spec, decoder.step_ops
        model = _Model(panel=decoder.panel_kernel.address, rms=ops.addresses["rms_norm_f32"],
                       rope=ops.addresses["rope_f32"], attn=decoder.attention_kernel.addresses[torch.float32],
                       hidden=s.hidden_size, heads=s.num_heads, kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                       inter=s.intermediate_size, eps=s.rms_norm_eps, scale=s.attention_scale,
                       softcap=s.attn_softcap or 0.0, lanes=ops.f32_lanes, sandwich=int(bool(spec.sandwich_norms)))
        experts = {}
        for li, weights in enumerate(packed["layers"]):
            if "experts" in weights:  # a routed layer: no dense gate_up / down (the C code skips a NULL gate_up)
                arrays = [(_ptr * len(weights["experts"]))(*(pair[part].panels.data_ptr()
                                                             for pair in weights["experts"])) for part in (0, 1)]
                experts[li] = _MoeLayer(gate_up=ctypes.addressof(arrays[0]), down=ctypes.addressof(arrays[1]))
                experts[li].arrays = arrays  # the struct holds their addresses: kept alive with it
        layers = layer_structs(decoder, packed, cache, _panels)
        self._memo[decoder] = (weakref.ref(first), weakref.ref(cache), model, layers, experts)
        return model, layers, experts


def layer_structs(decoder, packed: dict, cache, address) -> ctypes.Array:
    """The C array of struct layer for `decoder`'s layers (`packed`: its packed weights, ``address(weight)`` a
    packed weight's data address, None for None) on `cache`: the tensors' addresses, in the decoder's dtype."""
    s, layers = decoder.shape, []
    for li, (weights, tensors) in enumerate(zip(packed["layers"], decoder.layers)):
        key = s.layers[li].rope
        kA, vA, kB, vB = DecodeAttentionKernel.segments(cache, li)
        layers.append(_Layer(
            input_norm=_data(tensors.get("input_layernorm")),
            post_attn_norm=_data(tensors.get("post_attention_layernorm")),
            pre_ff_norm=_data(tensors.get("pre_feedforward_layernorm")),
            post_ff_norm=_data(tensors.get("post_feedforward_layernorm")),
            q_norm=_data(tensors.get("q_norm")), k_norm=_data(tensors.get("k_norm")),
            qkv=address(weights["qkv"]), qkv_bias=_data(tensors["b_qkv"]),
            o=address(weights["o"]), o_bias=_data(tensors["b_o"]),
            gate_up=address(weights.get("gate_up")), gate_up_bias=_data(tensors.get("b_gate_up")),
            down=address(weights.get("down")), down_bias=_data(tensors.get("b_down")),
            cos=decoder.rope.cos[key].data_ptr(), ssin=decoder.rope.sin[key].data_ptr(),
            rotary_dim=decoder.rope.cos[key].shape[-1],
            kA=kA.data_ptr(), vA=vA.data_ptr(), kAr=kA.stride(0), kAh=kA.stride(1), kAd=kA.stride(2),
            vAr=vA.stride(0), vAh=vA.stride(1), kB=kB.data_ptr(), vB=vB.data_ptr(), kBr=kB.stride(0),
            kBh=kB.stride(1), kBd=kB.stride(2), vBr=vB.stride(0), vBh=vB.stride(1)))
    return (_Layer * len(layers))(*layers)  # one C array: the step walks it


class DecodeLoop:
    """A generate call's decode loop in C (``decode_loop_f32``; bf16: cpu_bf16_step.loop, ``decode_loop_bf16``, whose
    subclass binds `_bind` to the bf16 one-call step): from a step whose logits are ready, each step's
    tokens are chosen (cpu_sampling.c), recorded and checked against the stop tokens, and the next step decoded as
    one C call (`DecodeLayerKernel.step`), without returning to Python between steps: at 16 rows of a tiny model the
    Python loop around a step's C calls took as long as the calls. `run` returns after the last step, once every row
    has stopped, or once enough rows have stopped that the caller drops them (native_rollout.py drops them and
    decodes that step, then runs the loop again on the rows left). Same tokens and log-probs as the Python loop, bit
    for bit: the same kernels on the same arguments in the same order (tests/engines/test_cpu_decode_layer.py)."""

    def __init__(self, kernel: DecodeLayerKernel, decoder, cache, sampler: cpu_sampling.SamplingKernel, *,
                 greedy: bool, temperature: float, top_k: int, top_p: float, stop_ids: torch.Tensor, max_new: int,
                 compact_fraction: float):
        self.kernel, self.decoder, self.cache, self.sampler = kernel, decoder, cache, sampler
        self.greedy, self.temperature = greedy, 1.0 if greedy else float(temperature)
        self.top_k, self.top_p = int(top_k), float(top_p)
        self.stop_ids = stop_ids.to(torch.int64).contiguous()
        self.max_new, self.compact_fraction = max_new, compact_fraction
        s = decoder.shape
        self.windows = (ctypes.c_long * s.num_layers)(*(layer.window or 0 for layer in s.layers))
        # the most keys a step attends to (the attention's scratch is sized for them once)
        self.keys = cache.prompt_len + max_new if cache.shared else cache.offset + max_new

    def run(self, rows, prompt_bias: torch.Tensor, logits: torch.Tensor, positions: torch.Tensor, step: int, out,
            draws) -> tuple[int, torch.Tensor, bool]:
        """Steps from `step` on for the running rows (kv_cache.RunningRows, their prompt masks [R, P]), whose
        logits [R, V] are `logits` and whose next positions [R] int64 are `positions` (advanced in place); `out`:
        native_rollout's record of the tokens (its tensors written in place); draws: sampling.StepUniforms, or None
        when greedy. Returns (the step it stopped at, that step's tokens [R], whether the loop is finished)."""
        if positions.dtype != torch.int64 or not positions.is_contiguous():  # the C loop advances them in place
            raise TypeError(f"DecodeLoop.run: positions must be contiguous int64, got {positions.dtype}")
        decoder, cache = self.decoder, self.cache
        s, threads = decoder.shape, torch.get_num_threads()
        R = logits.shape[0]
        prompt_index = rows.prompt_index.to(torch.int64).contiguous() if cache.shared else None
        V, call, step_struct, keep = self._bind(R, threads)
        if logits.shape[1] != V:  # the C loop reads rows of V logits
            raise ValueError(f"DecodeLoop.run: logits of {logits.shape[1]} tokens for a head of {V}")
        pads = decoder.attention_kernel.starts(prompt_bias, cache.prompt_len, 1, (None,))[None].contiguous()
        step_struct.positions, step_struct.prompt_index = positions.data_ptr(), _data(prompt_index)
        work = {"tokens": torch.empty(R, dtype=torch.int64), "log_probs": torch.empty(R),
                "sums": torch.empty(R, -(-V // cpu_sampling.BLOCK), dtype=torch.float64),
                "logits": torch.empty(R, V), "starts": torch.empty(s.num_layers, R, dtype=torch.int32)}
        # top-k / top-p as SamplingKernel.choose decides it: never when greedy, k only below the vocabulary
        filtered = not self.greedy and (0 < self.top_k < V or self.top_p < 1.0)
        state = _Loop(sample=self.sampler.address, filtered=self.sampler.filtered_address if filtered else None,
                      top_k=self.top_k, top_p=self.top_p, vocab=V, temperature=self.temperature,
                      greedy=int(self.greedy),
                      max_new=self.max_new, stop_ids=self.stop_ids.data_ptr(), n_stop=self.stop_ids.numel(),
                      compact_fraction=self.compact_fraction, out_tokens=out.tokens.data_ptr(),
                      out_log_probs=out.log_probs.data_ptr(), out_lengths=out.lengths.data_ptr(),
                      row_index=out.row_index.data_ptr(), done=out.done.data_ptr(), n_done=out.n_done,
                      positions=positions.data_ptr(), pads=pads.data_ptr(), windows=ctypes.addressof(self.windows),
                      prompt_len=cache.prompt_len, offset=cache.offset, shared=int(cache.shared),
                      step_logits=_data(keep.get("step_logits")), **{name: t.data_ptr() for name, t in work.items()})
        logits = logits.float().contiguous()
        while True:
            if draws is not None:  # the draws of `step` on, as one [steps, R] table
                table, end = draws.block(step)
                state.uniforms, state.uniforms_first, state.uniforms_end = table.data_ptr(), step, end
            status = call(ctypes.addressof(state), step, logits.data_ptr())
            step = state.step
            if status != 2:  # 2: the draws ran out before `step`, whose logits are in work["logits"]
                break
            logits = work["logits"]
        out.n_done = state.n_done
        if status == -1:
            tokens = work["tokens"]
            bad = tokens[(tokens < 0) | (tokens >= decoder.embed.shape[0])]
            raise IndexError(f"native rollout: token ids {bad.tolist()[:8]} are outside the embedding's "
                             f"{decoder.embed.shape[0]} rows")
        if status == -2:
            raise ValueError(NOT_A_DISTRIBUTION)
        if status == -3:
            raise MemoryError(cpu_sampling.filtered_scratch_error(R, V))
        if status == -4:
            raise RuntimeError("native rollout: a bf16 decode step in the C loop failed (its router)")
        return step, work["tokens"], status == 1

    def _bind(self, R: int, threads: int) -> tuple[int, object, ctypes.Structure, dict]:
        """The loop's C call for R rows: (vocabulary size, ``call(state address, step, logits address) -> status``,
        the step struct whose positions and prompt index the caller sets, tensors to keep alive during the call)."""
        decoder, kernel = self.decoder, self.kernel
        model, layers, head = kernel._one_call(decoder, self.cache, threads)
        step_struct, *_ = kernel._step(decoder, R, threads, self.keys)
        x = torch.empty(R, decoder.shape.hidden_size)
        step_struct.x = x.data_ptr()
        scale = 0.0 if decoder.embed_scale is None else float(decoder.embed_scale)
        args = (ctypes.addressof(model), ctypes.addressof(layers), len(layers), ctypes.addressof(step_struct))
        rest = (decoder.embed.data_ptr(), decoder.embed.shape[0], scale, decoder.norm.data_ptr(),
                head.panels.data_ptr())

        def call(state: int, step: int, logits: int) -> int:
            return kernel._loop(*args, state, step, logits, *rest)

        return head.out_features, call, step_struct, {"x": x}
