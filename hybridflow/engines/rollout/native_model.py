"""The decoder the native rollout runs: one pre-norm decoder forward pass for every architecture in arch_specs.py.

An architecture is data (arch_specs.ArchSpec): which norms (q/k norm, Gemma's (1 + weight) RMSNorm and its norms
around the attention and MLP outputs), which rope (rope.py), which layers slide, the attention scale, the MLP
activation, soft-capping, embedding scaling and how its HF names map onto the fused tensors below. The arithmetic
follows transformers' modeling files (RMSNorm in fp32, rotate-half rotary embeddings, grouped-query attention, gated
MLP) so fp32 greedy decoding picks the same tokens. Differences are for speed:
  * q/k/v projections are one fused matrix ``w_qkv`` and gate/up one ``w_gate_up``; incoming HF tensors are copied
    into slices of them (``load``), so a weight update never rebuilds anything;
  * the KV cache is pre-allocated and written in place, each prompt's part stored once for its n samples
    (kv_cache.py, which also holds the decode attention);
  * a decode step is 2-D ``[rows, hidden]`` end to end;
  * decode attention is batched matmuls and one softmax: for one query per row, torch's CPU flash-attention kernel
    was 2-3x slower than that (measured at 64 rows);
  * on CPU the matmul weights are packed once into a kernel's own layout and re-packed lazily after a weight update
    (by default only from hidden size 128 up for the panel kernel, 256 for oneDNN, below which packing was slower):
    fp32 -> panels of 16 output columns for the C kernel of cpu_linear.py (``matmul == "panel"``; oneDNN's layout
    where that kernel is not the default or cannot be built, or with ``linear_kernel=False``); bf16 on CPUs with bf16
    units -> the tiles of cpu_bf16_linear.py's C kernel (``matmul == "bf16_tiles"``: AMX's product, or AVX512-BF16's),
    where it cannot be built (or with ``linear_kernel=False``) oneDNN's blocked layout (onednn_linear.py; same
    arithmetic, ~1.6x faster layer matmuls at 64 rows of the mid model than F.linear), or,
    with ``int8=True``, int8 weights for the layer matmuls (int8_linear.py; embeddings, norms, attention, the KV
    cache and the output head stay in ``dtype``). The packed copies cost a second copy of the weights' memory.
"""

from __future__ import annotations

import re
import weakref

import torch
import torch.nn.functional as F

from hybridflow import device as hf_device
from hybridflow.engines.rollout import cpu_bf16_linear, cpu_bf16_step, cpu_linear
from hybridflow.engines.rollout.arch_specs import DecoderShape, resolve, supported_architectures
from hybridflow.engines.rollout.compiled_step import packed_linear as compiled_packed_linear
from hybridflow.engines.rollout.compiled_step import register_decoder
from hybridflow.engines.rollout.compiled_step import routed_experts as compiled_routed_experts
from hybridflow.engines.rollout.int8_linear import check_int8_supported, int8_linear, pack_int8
from hybridflow.engines.rollout.kv_cache import KVCache, RunningRows, attention_bias, decode_attention, softcap_scores
from hybridflow.engines.rollout.moe import dense_experts, dispatch, moe_mlp, route
from hybridflow.engines.rollout.onednn_linear import MIN_PACKED_WIDTH, onednn_available, onednn_linear, pack_onednn
from hybridflow.engines.rollout.rope import rotary_tables

__all__ = ["DecoderShape", "NativeDecoder", "supported_architectures"]

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
# MoE layers: the per-expert names save_pretrained writes -> (fused tensor, part); in memory transformers holds the
# fused [E, 2I, H] "mlp.experts.gate_up_proj" and [E, H, I] "mlp.experts.down_proj" (the names weight sync sends)
_EXPERT_NAME = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PART = {"gate_proj": ("experts_gate_up", "gate"), "up_proj": ("experts_gate_up", "up"),
                "down_proj": ("experts_down", None)}
_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, then scale; ``weight`` already holds Gemma's (1 + w) when offset.

    torch's fused rms_norm gave bitwise-equal fp32 results and ran 1.3x faster than the four-op form (measured at
    [64, 512]). In low precision Llama casts before scaling, Gemma after.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    if offset:
        return (F.rms_norm(x.float(), weight.shape, None, eps) * weight.float()).to(x.dtype)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] features of x: x*cos + rotate_half(x)*sin, the rest unchanged.

    rotate_half(x) = roll(x)*sign with the sign folded into signed_sin: bitwise equal to transformers' form, since
    (-a)*b == a*(-b) in IEEE arithmetic. Two products and a sum, in transformers' order: a fused ``addcmul`` rounds
    differently, and that alone kept the fp32 prefill from being bitwise equal to the training engine's forward.
    """
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + torch.roll(x, dim // 2, dims=-1) * signed_sin
    rot = x[..., :dim]
    return torch.cat((rot * cos + torch.roll(rot, dim // 2, dims=-1) * signed_sin, x[..., dim:]), -1)


def prefill_masks(shape: DecoderShape, attention_mask: torch.Tensor) -> dict:
    """Boolean attention masks ``[B, 1, P, P]`` (True: may attend) per sliding window size of ``shape.windows``
    (None: full causal) from the prompts' ``attention_mask [B, P]``: sliding layers see keys less than `window`
    columns back, as transformers' mask does."""
    P = attention_mask.shape[1]
    device = attention_mask.device
    key_valid = attention_mask.bool()
    index = torch.arange(P, device=device)
    distance = index[:, None] - index[None, :]  # query column - key column
    # a padding query attends to itself so that its (unused) output stays finite instead of NaN
    eye = torch.eye(P, dtype=torch.bool, device=device)
    masks = {}
    for window in shape.windows:
        allowed = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
        masks[window] = ((allowed[None] & key_valid[:, None, :]) | eye[None])[:, None]
    return masks


class NativeDecoder:
    """Weights of one checkpoint in fused, generation-friendly tensors, plus prefill and decode steps."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device, max_positions: int, int8: bool = False,
                 prepack: bool | None = None, linear_kernel: bool | None = None, huge_pages: bool | None = None):
        self.shape = s = self._resolve_shape(config)
        self.spec = s.spec
        if prepack is None:  # auto: where it was measured to pay (cpu_linear.MIN_PANEL_WIDTH, onednn MIN_PACKED_WIDTH)
            panel = dtype == torch.float32 and device.type == "cpu" and cpu_linear.kernel_for(linear_kernel) is not None
            # the bf16 tiles too from hidden 128 (AMX: a tiny model's 16-row generate call 26 ms against F.linear's 41)
            tiles = (dtype == torch.bfloat16 and device.type == "cpu" and linear_kernel is not False
                     and cpu_bf16_linear.load() is not None)
            prepack = s.hidden_size >= (cpu_linear.MIN_PANEL_WIDTH if panel or tiles else MIN_PACKED_WIDTH)
        self.panel_kernel = None  # cpu_linear.PanelLinearKernel when matmul == "panel"
        self.bf16_kernel = None  # cpu_bf16_linear.Bf16LinearKernel when matmul == "bf16_tiles"
        if int8:
            check_int8_supported(device)
            self.matmul = "int8"
        elif prepack and device.type == "cpu" and onednn_available(dtype):  # fp32; bf16 where the CPU has bf16 units
            # the C kernel of packed weights unless linear_kernel=False or it cannot run here: fp32 -> the panel kernel
            # (cpu_linear.py), bf16 -> the bf16 tiles (cpu_bf16_linear.py); else oneDNN's packed product
            if dtype == torch.float32:
                self.panel_kernel = cpu_linear.kernel_for(linear_kernel)
            elif linear_kernel is not False:
                self.bf16_kernel = cpu_bf16_linear.load()
            self.matmul = ("panel" if self.panel_kernel is not None else "bf16_tiles" if self.bf16_kernel is not None
                           else "onednn")
        else:
            self.matmul = "dense"  # F.linear on the fused tensors (GPUs, emulated bf16, small models, prepack=False)
        if linear_kernel and self.matmul not in ("panel", "bf16_tiles"):
            built = (cpu_linear.load() if dtype == torch.float32 else cpu_bf16_linear.load()) is not None
            raise ValueError(f"native rollout: linear_kernel=True is the CPU projection kernel of packed weights "
                             f"(fp32: cpu_linear.py; bf16: cpu_bf16_linear.py, on CPUs with AMX or AVX512-BF16), "
                             f"but this decoder's projections are {self.matmul!r} (dtype {dtype}, device "
                             f"{device.type}, prepack={prepack}, kernel built: {built}); leave linear_kernel unset to "
                             "choose by device")
        self.prepacked = self.matmul in ("panel", "onednn", "bf16_tiles")
        # the panel kernel's packed weights in transparent huge pages (device.huge_page_buffer): None = where the
        # machine allows it; True = required
        if huge_pages and not (self.matmul == "panel" and hf_device.huge_pages_available()):
            raise ValueError(f"native rollout: huge_pages=True puts the CPU fp32 projection kernel's packed weights in "
                             f"transparent huge pages, but this decoder's projections are {self.matmul!r} and huge "
                             f"pages are {'' if hf_device.huge_pages_available() else 'not '}available here "
                             "(Linux, THP not 'never', HYBRIDFLOW_HUGE_PAGES not 0); leave huge_pages unset")
        self.huge_pages = huge_pages is not False and self.matmul == "panel" and hf_device.huge_pages_available()
        self._packed: dict | None = None  # packed weights; None = (re)build before the next forward
        self._stale: dict | None = None  # the packed weights an update dropped: the panel re-pack writes into them
        self.dtype, self.device = dtype, device
        self.q_size = s.num_heads * s.head_dim
        self.kv_size = s.num_kv_heads * s.head_dim
        self.act = _ACTIVATIONS[s.activation]
        self.offset_norm = self.spec.norm_offset != 0.0
        # routing replay (moe.py): while a list, every MoE layer of a forward appends its chosen experts [T, k]
        self.route_log: list[torch.Tensor] | None = None
        # the eager decode's attention kernel (cpu_attention.DecodeAttentionKernel), set by the rollout engine; None:
        # kv_cache.decode_attention (torch matmuls)
        self.attention_kernel = None
        # the eager decode's rotary embedding and RMSNorm as one call each (cpu_step_ops.StepOpsKernel), set
        # by the rollout engine; active (_step_ops) only inside decode() and the prefill's prompt_layers
        self.step_ops = None
        self._step_ops = None
        # the eager fp32 decode step as one C call, or its layers as two each (cpu_decode_layer.DecodeLayerKernel), set
        # by the rollout engine; used where its ``applies`` holds and the attention kernel takes the step
        self.layer_kernel = None
        self._kernel_reads = None  # (cache, kernel, whether the kernel reads that cache), asked every decode step

        def empty(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

        self.embed = empty(s.vocab_size, s.hidden_size)
        self.norm = empty(s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else empty(s.vocab_size, s.hidden_size)
        # HF multiplies by a 0-d tensor of the weights' dtype (Gemma3TextScaledWordEmbedding): the same rounding here
        self.embed_scale = None if s.embed_scale is None else torch.tensor(s.embed_scale).to(dtype=dtype, device=device)
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for shape in s.layers:
            layer = {
                "w_qkv": empty(self.q_size + 2 * self.kv_size, s.hidden_size),
                "b_qkv": empty(self.q_size + 2 * self.kv_size) if s.qkv_bias else None,
                "w_o": empty(s.hidden_size, self.q_size),
                "b_o": empty(s.hidden_size) if s.o_bias else None,
            }
            if shape.moe:
                E, inter = s.num_experts, s.moe_intermediate_size
                layer |= {"router": empty(E, s.hidden_size), "experts_gate_up": empty(E, 2 * inter, s.hidden_size),
                          "experts_down": empty(E, s.hidden_size, inter)}
            else:
                layer |= {
                    "w_gate_up": empty(2 * s.intermediate_size, s.hidden_size),
                    "b_gate_up": empty(2 * s.intermediate_size) if s.mlp_bias else None,
                    "w_down": empty(s.hidden_size, s.intermediate_size),
                    "b_down": empty(s.hidden_size) if s.mlp_bias else None,
                }
            for name in self.spec.layer_norms:
                width = s.head_dim if name.startswith("self_attn.") else s.hidden_size
                layer[name.removeprefix("self_attn.")] = empty(width)
            self.layers.append(layer)
        self.rope = rotary_tables(config, {layer.rope for layer in s.layers}, s.head_dim, max_positions, dtype, device)
        self.max_positions = max_positions if self.rope.limit is None else min(max_positions, self.rope.limit)

    def _resolve_shape(self, config) -> DecoderShape:
        """The shape the tensors are allocated for; a tensor-parallel rank's is its slice (tensor_parallel.py)."""
        return resolve(config)

    # ------------------------------------------------------------------ weights
    def expected_names(self) -> set[str]:
        """The HF parameter names a full checkpoint of this shape must provide."""
        s = self.shape
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not s.tie_word_embeddings:
            names.add("lm_head.weight")
        bias = {"qkv": s.qkv_bias, "o": s.o_bias, "gate_up": s.mlp_bias, "down": s.mlp_bias}
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            names |= {f"{p}{norm}.weight" for norm in self.spec.layer_norms}
            if s.layers[i].moe:
                names.add(f"{p}mlp.gate.weight")
                names |= {f"{p}mlp.experts.{e}.{m}.weight" for e in range(s.num_experts) for m in _EXPERT_PART}
            for module, (fused, _) in self.spec.projections.items():
                if s.layers[i].moe and fused in ("gate_up", "down"):
                    continue
                names.add(f"{p}{module}.weight")
                if bias[fused]:
                    names.add(f"{p}{module}.bias")
        return names

    def missing_names(self, loaded: set[str]) -> list[str]:
        """expected_names() not in `loaded`, where a fused experts tensor stands for its per-expert names."""
        missing = self.expected_names() - loaded
        for name in loaded:
            prefix, fused, _ = name.rpartition("mlp.experts.")
            if fused in ("gate_up_proj", "down_proj"):
                parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
                missing -= {f"{prefix}mlp.experts.{e}.{m}.weight" for e in range(self.shape.num_experts) for m in parts}
        return sorted(missing)

    def _slot(self, name: str) -> torch.Tensor | None:
        """The tensor (or slice of a fused tensor) that HF parameter `name` lives in; None for ignored buffers."""
        if name == "model.embed_tokens.weight":
            return self.embed
        if name == "model.norm.weight":
            return self.norm
        if name == "lm_head.weight":
            return self.lm_head  # the embedding itself when tied: an update carries equal values under both names
        if name.endswith("inv_freq") or name.endswith("embed_scale"):
            return None  # buffers the decoder computes itself (rope.py, embed_scale)
        match = _LAYER_NAME.fullmatch(name)
        if match is None or int(match.group(1)) >= self.shape.num_layers:
            return self._unknown(name)
        layer, rest = self.layers[int(match.group(1))], match.group(2)
        module, _, kind = rest.rpartition(".")
        if "router" in layer and (expert := self._expert_slot(layer, rest)) is not None:
            return expert
        if module in self.spec.layer_norms and kind == "weight":
            return layer[module.removeprefix("self_attn.")]
        if module not in self.spec.projections or kind not in ("weight", "bias"):
            return self._unknown(name)
        fused, part = self.spec.projections[module]
        if f"w_{fused}" not in layer:  # a dense MLP name on an MoE layer
            return self._unknown(name)
        target = layer[f"{kind[0]}_{fused}"]
        if target is None:
            raise ValueError(f"native rollout: got {name!r} but this {self.shape.arch} config has no such bias")
        q, kv, inter = self.q_size, self.kv_size, self.shape.intermediate_size
        bounds = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, inter), "up": (inter, 2 * inter)}
        return target if part is None else target[slice(*bounds[part])]

    def _expert_slot(self, layer: dict, rest: str) -> torch.Tensor | None:
        """An MoE layer's router / expert tensor for layer-relative name `rest`, per-expert or fused; None if not one."""
        fused = {"mlp.gate.weight": "router", "mlp.experts.gate_up_proj": "experts_gate_up",
                 "mlp.experts.down_proj": "experts_down"}
        if rest in fused:
            return layer[fused[rest]]
        expert = _EXPERT_NAME.fullmatch(rest)
        if expert is None or int(expert.group(1)) >= self.shape.num_experts:
            return None
        target_name, part = _EXPERT_PART[expert.group(2)]
        target, inter = layer[target_name][int(expert.group(1))], self.shape.moe_intermediate_size
        return target if part is None else target[:inter] if part == "gate" else target[inter:]

    def _unknown(self, name: str):
        examples = [f"model.layers.0.{m}.weight" for m in list(self.spec.projections)[:2]]
        raise KeyError(
            f"native rollout: unknown parameter {name!r} for a {self.shape.arch} checkpoint; expected HF names such "
            f"as {examples} (strip wrapper prefixes like '_orig_mod.' or '_fsdp_wrapped_module.' before sending)"
        )

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one HF tensor into its place; returns False for buffers the decoder does not use."""
        slot = self._slot(name)
        if slot is None:
            return False
        if tuple(slot.shape) != tuple(tensor.shape):
            raise ValueError(
                f"native rollout: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(slot.shape)} "
                "(is the update from a different model size?)"
            )
        if self.offset_norm and name.endswith("norm.weight"):
            tensor = tensor.detach().float() + self.spec.norm_offset  # Gemma: HF computes 1.0 + weight.float()
        slot.copy_(tensor.detach())
        if self._packed is not None:
            self._stale, self._packed = self._packed, None
        return True

    def _pack_all(self) -> dict:
        # the projections; with int8 the routed experts stay in dtype and run as plain matmuls (moe.py)
        names = ("qkv", "o", "gate_up", "down")
        stale, self._stale = self._stale, None
        buffer = None  # the panels' one buffer when this is their first pack
        if self.matmul == "int8":  # the output head stays in fp32
            layers = [{n: pack_int8(layer[f"w_{n}"], layer[f"b_{n}"]) for n in names if f"w_{n}" in layer}
                      for layer in self.layers]
            return {"layers": layers, "lm_head": None}
        if self.matmul == "panel":  # into the stale panels' memory where their shapes match (cpu_linear.pack)
            pack = self.panel_kernel.pack
            if stale is None:  # the first pack: every panel in one buffer, in huge pages where asked
                stale, buffer = self._panel_buffer(names)
        elif self.matmul == "bf16_tiles":  # into the stale tiles' memory where their shapes match
            pack = self.bf16_kernel.pack
        else:
            def pack(weight: torch.Tensor, out=None):
                return pack_onednn(weight)
        old_layers = stale["layers"] if stale is not None else [{} for _ in self.layers]
        layers = [{n: pack(layer[f"w_{n}"], old.get(n)) for n in names if f"w_{n}" in layer}
                  for layer, old in zip(self.layers, old_layers)]
        for packed, layer, old in zip(layers, self.layers, old_layers):
            if "router" in layer:  # each routed expert's pair, packed like a dense MLP
                old_experts = old.get("experts") or [(None, None)] * len(layer["experts_gate_up"])
                packed["experts"] = [(pack(gate_up, old_gate_up), pack(down, old_down))
                                     for gate_up, down, (old_gate_up, old_down)
                                     in zip(layer["experts_gate_up"], layer["experts_down"], old_experts)]
                if self.matmul == "bf16_tiles":  # the bf16 step's router product (cpu_bf16_step.py, cpu_moe_router.py)
                    packed["router"] = pack(layer["router"], old.get("router"))
        head = pack(self.lm_head, stale["lm_head"] if stale is not None else None)
        if buffer is not None:  # huge pages asked for: any the kernel gave as 4 KiB ones, collapsed now
            hf_device.collapse_huge_pages(buffer)
        return {"layers": layers, "lm_head": head}

    def _panel_buffer(self, names: tuple[str, ...]) -> tuple[dict, torch.Tensor | None]:
        """Zeroed panels of every projection, laid out as _pack_all returns them, one after another in one buffer:
        in transparent huge pages (device.huge_page_buffer) when ``huge_pages``, since a decode step streams them all
        from memory once per step. -> (the panels, that buffer or None)"""
        shapes = []
        for layer in self.layers:
            shapes += [tuple(layer[f"w_{n}"].shape) for n in names if f"w_{n}" in layer]
            if "router" in layer:
                for gate_up, down in zip(layer["experts_gate_up"], layer["experts_down"]):
                    shapes += [tuple(gate_up.shape), tuple(down.shape)]
        shapes.append(tuple(self.lm_head.shape))
        kernel = self.panel_kernel
        buffer = hf_device.huge_page_buffer(kernel.panel_bytes(shapes)) if self.huge_pages else None
        panels = iter(kernel.panel_weights(shapes, buffer))
        layers = []
        for layer in self.layers:
            packed = {n: next(panels) for n in names if f"w_{n}" in layer}
            if "router" in layer:
                packed["experts"] = [(next(panels), next(panels)) for _ in layer["experts_gate_up"]]
            layers.append(packed)
        return {"layers": layers, "lm_head": next(panels)}, buffer

    def packed_weights(self) -> dict:
        """The packed projections ({"layers": [{name: packed}], "lm_head": packed}), packed now if a weight update
        dropped them. A re-pack writes the panel kernel's panels into the old ones where their shapes match, and makes
        new tensors otherwise (oneDNN's, int8's): holders of their addresses must check (cpu_decode_layer.py)."""
        if self._packed is None:
            self._packed = self._pack_all()
        return self._packed

    def _linear(self, li: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """One of layer li's projections ('qkv', 'o', 'gate_up', 'down') applied to x [..., in]."""
        layer = self.layers[li]
        if self.matmul == "dense":
            return F.linear(x, layer[f"w_{name}"], layer[f"b_{name}"])
        if torch.compiler.is_compiling():  # packed weights are opaque to the compiler: one op runs them
            return compiled_packed_linear(x, self.compile_key(), li, name, -1)
        return self.packed_linear(li, name, x)

    def packed_linear(self, li: int, name: str, x: torch.Tensor, expert: int = -1) -> torch.Tensor:
        """x [..., in] times a packed weight: layer li's projection `name`; with `expert` >= 0 that routed expert's
        'gate_up' or 'down'; li = -1: the output head ('lm_head', not int8). Output in x's dtype."""
        multiply = (self.panel_kernel.linear if self.matmul == "panel" else self.bf16_kernel.linear
                    if self.matmul == "bf16_tiles" else onednn_linear)
        if li < 0:
            return multiply(x, self.packed_weights()["lm_head"], None)
        packed = self.packed_weights()["layers"][li]
        if expert >= 0:
            return multiply(x, packed["experts"][expert][name == "down"], None)
        if self.matmul == "int8":
            return int8_linear(x, packed[name])
        return multiply(x, packed[name], self.layers[li][f"b_{name}"])

    def packed_out(self, li: int, name: str, expert: int = -1) -> int:
        """The output width of packed_linear(li, name, ., expert)."""
        if li < 0:
            return self.lm_head.shape[0]
        layer = self.layers[li]
        return layer[f"experts_{name}"].shape[1] if expert >= 0 else layer[f"w_{name}"].shape[0]

    def compile_key(self) -> str:
        """This decoder's key for compiled_step.packed_linear (registered on first use)."""
        if getattr(self, "_compile_key", None) is None:
            self._compile_key = register_decoder(self)
        return self._compile_key

    # ------------------------------------------------------------------ forward
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ops = self._step_ops
        if ops is not None and ops.normalises(x, weight):
            return ops.rms_norm(x, weight, self.shape.rms_norm_eps, self.offset_norm)
        return _rms_norm(x, weight, self.shape.rms_norm_eps, self.offset_norm)

    def _mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        layer, s = self.layers[li], self.shape
        if s.layers[li].moe:
            if torch.compiler.is_compiling():  # the dispatch reads group sizes on the host: one op the compiler calls
                flat = x.reshape(-1, x.shape[-1])
                weights, experts = route(flat, layer["router"], s.experts_per_token, s.norm_topk_prob)
                return compiled_routed_experts(flat, weights, experts, self.compile_key(), li).view_as(x)
            return moe_mlp(x, layer["router"], s.experts_per_token, s.norm_topk_prob, self._expert_mlp(li),
                           record=self.route_log)
        gate, up = self._linear(li, "gate_up", x).chunk(2, dim=-1)
        return self._linear(li, "down", self.act(gate).mul_(up))

    def routed_experts(self, li: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """MoE layer li's experts on tokens x [T, H] routed to `experts` with `weights` [T, k] -> [T, H]."""
        return dispatch(x, weights, experts, self.shape.num_experts, self._expert_mlp(li))

    def _expert_mlp(self, li: int):
        """moe.py's expert_mlp for layer li: its packed (gate_up, down) expert pairs, or F.linear."""
        layer = self.layers[li]
        if not self.prepacked:
            return dense_experts(layer["experts_gate_up"], layer["experts_down"], self.act)
        gate_mul = getattr(self.layer_kernel, "act_mul", None) if self.dtype == torch.bfloat16 else None

        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up = self.packed_linear(li, "gate_up", rows, expert)
            # bf16 on CPU: the gate as one C call where it gives torch's bits (cpu_decode_layer.act_mul)
            act = gate_mul(gate_up, self.shape.activation) if gate_mul is not None else None
            if act is None:
                gate, up = gate_up.chunk(2, dim=-1)
                act = self.act(gate) * up
            return self.packed_linear(li, "down", act, expert)

        return expert_mlp

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._head(self._rms(h, self.norm))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., V] of the final norm's output h."""
        if self.prepacked:
            if torch.compiler.is_compiling():
                logits = compiled_packed_linear(h, self.compile_key(), -1, "lm_head", -1).float()
            else:
                logits = self.packed_linear(-1, "lm_head", h).float()
        else:
            logits = F.linear(h, self.lm_head).float()
        cap = self.shape.final_softcap
        if cap is not None:  # Gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., hidden] (a tensor-parallel rank holds a vocabulary slice: tensor_parallel.py)."""
        return F.embedding(tokens, self.embed)

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Embed tokens [...] at positions [...] and run every layer; returns the last hidden states [..., hidden].

        ``attend(layer, q [..., heads, D], k [..., kv, D], v [..., kv, D]) -> [..., heads * D]`` (rotated q/k) stores
        the new K/V and attends: the only part in which the prefill, the eager and the fixed-shape step differ.
        """
        spec = self.spec
        x = self._embed(tokens)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rotate = self._rotation(positions)
        for li, layer in enumerate(self.layers):
            out = self._linear(li, "o", attend(li, *self._qkv(li, self._rms(x, layer["input_layernorm"]), rotate)))
            if spec.sandwich_norms:
                out = self._rms(out, layer["post_attention_layernorm"])
                x = x + out
                mlp = self._mlp(li, self._rms(x, layer["pre_feedforward_layernorm"]))
                x = x + self._rms(mlp, layer["post_feedforward_layernorm"])
            else:
                x = x + out
                x = x + self._mlp(li, self._rms(x, layer["post_attention_layernorm"]))
        return x

    def _qkv(self, li: int, h: torch.Tensor, rotate) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer li's rotated q [..., heads, D], rotated k and v [..., kv, D] from its input norm's output h."""
        s, lead = self.shape, h.shape[:-1]
        H, KV, D, key = s.num_heads, s.num_kv_heads, s.head_dim, s.layers[li].rope
        layer = self.layers[li]
        qkv = self._linear(li, "qkv", h)
        v = qkv[..., self.q_size + self.kv_size :].view(*lead, KV, D)
        if self.spec.qk_norm:
            q = rotate(self._rms(qkv[..., : self.q_size].view(*lead, H, D), layer["q_norm"]), key)
            k = rotate(self._rms(qkv[..., self.q_size : self.q_size + self.kv_size].view(*lead, KV, D),
                                 layer["k_norm"]), key)
        else:  # q and k heads rotated together
            qk = rotate(qkv[..., : self.q_size + self.kv_size].view(*lead, H + KV, D), key)
            q, k = qk[..., :H, :], qk[..., H:, :]
        return q, k, v

    def _rotation(self, positions: torch.Tensor):
        """``rotate(x [..., heads, D], rope key)`` at positions [...]: one kernel call inside an eager decode step
        (cpu_step_ops.py), else _rotate on the tables' rows gathered once per forward."""
        ops, rope = self._step_ops, self.rope
        if ops is not None and ops.reads_tables(rope):
            def rotate(x: torch.Tensor, key: str) -> torch.Tensor:
                if ops.rotates(x, rope.cos[key]):
                    return ops.rotate(x, rope.cos[key], rope.sin[key], positions)
                return _rotate(x, rope.cos[key][positions].unsqueeze(-2), rope.sin[key][positions].unsqueeze(-2))
            return rotate
        tables = {key: (cos[positions].unsqueeze(-2), rope.sin[key][positions].unsqueeze(-2))
                  for key, cos in rope.cos.items()}  # [..., 1, rotary_dim]
        return lambda x, key: _rotate(x, *tables[key])

    def prefill(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """Run the unique prompts [B, P] once and write their K/V into the cache's prompt part (shared by samples).

        Returns fp32 logits of the last prompt position [B, V].
        """
        B, P = input_ids.shape
        masks = prefill_masks(self.shape, attention_mask)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # [B * P, heads, D] -> [B, heads, P, D]
            q, k, v = (t.view(B, P, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            return self.prompt_attention(li, q, k, v, masks, cache).transpose(1, 2).reshape(B * P, self.q_size)

        hidden, normed = self.prompt_layers(input_ids.reshape(-1), position_ids.reshape(-1), attend)
        return self.prompt_logits(hidden.view(B, P, -1)[:, -1], normed)

    def prompt_layers(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> tuple[torch.Tensor, bool]:
        """Every layer on the prompts' tokens [T] at positions [T] (``attend`` as _layers takes it) -> (hidden
        [T, hidden], normed). On CPU in bf16, where the rollout engine set the step kernels, the layers' small ops are
        the decode step's C calls (cpu_bf16_step.layers) and hidden is the final norm's output (normed True); else
        _layers' residual stream (in fp32 with the step's norm and rotation kernels: torch's bits). `prompt_logits`
        takes either."""
        self._step_ops = self.step_ops
        try:
            if cpu_bf16_step.applies(self, self.layer_kernel):
                return cpu_bf16_step.layers(self, tokens, positions, attend, self.layer_kernel), True
            return self._layers(tokens, positions, attend), False
        finally:
            self._step_ops = None

    def prompt_logits(self, hidden: torch.Tensor, normed: bool) -> torch.Tensor:
        """fp32 logits [..., V] of rows of `prompt_layers`' hidden states."""
        return self._head(hidden) if normed else self._logits(hidden)

    def prompt_attention(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: dict,
                         cache) -> torch.Tensor:
        """Layer li's prefill attention: writes k, v [B, kv, P, D] through ``cache.write_prompts`` and returns the
        output [B, heads, P, D] for q [B, heads, P, D] under ``masks[window]`` (prefill_masks)."""
        s = self.shape
        G = s.num_heads // s.num_kv_heads
        cache.write_prompts(li, k, v)
        k, v, mask = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), masks[s.layers[li].window]
        if s.attn_softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.attention_scale)
        # SDPA cannot soft-cap: transformers' eager attention, written out
        scores = softcap_scores(torch.matmul(q, k.transpose(-1, -2)) * s.attention_scale, s.attn_softcap)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
        return torch.matmul(probs.to(q.dtype), v)

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: RunningRows,
        prompt_bias: torch.Tensor, column: int
    ) -> torch.Tensor:
        """One step for the running rows. tokens, positions [rows]; prompt_bias [rows, P] (0, or -inf at the prompt's
        left padding). Writes the K/V of generated token `column` and returns fp32 logits [rows, V].
        """
        s = self.shape
        kernel, starts = self.attention_kernel, None
        if kernel is not None and self._kernel_supports(kernel, cache):  # cpu_attention.py: first attended column
            starts = kernel.starts(prompt_bias, cache.prompt_len, column + 1, s.windows)
        if starts is None:
            biases = {w: attention_bias(cache, prompt_bias, column + 1, window=w) for w in s.windows}
        r, G = tokens.shape[0], s.num_heads // s.num_kv_heads

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q = q.reshape(r, s.num_kv_heads, G, s.head_dim)
            window = s.layers[li].window
            if starts is not None:  # the kernel writes k, v into the cache itself (cpu_attention.py)
                out = kernel(q, cache, li, rows, starts[window], column + 1, s.attention_scale, s.attn_softcap,
                             keys=k, values=v)
            else:
                cache.write_token(li, column, k, v)
                out = decode_attention(q, cache, li, rows, biases[window], column + 1, s.attention_scale,
                                       s.attn_softcap)
            return out.reshape(r, self.q_size)

        self._step_ops = self.step_ops
        try:
            layers = self.layer_kernel
            if starts is not None and layers is not None and layers.applies_to(self):
                logits = layers.step(self, tokens, positions, cache, rows, starts, column + 1)
                if logits is not None:
                    return logits
                x = self._embed(tokens)
                if self.embed_scale is not None:
                    x = x * self.embed_scale
                return self._logits(layers.layers(self, x.contiguous(), positions, cache, rows, starts, column + 1))
            if cpu_bf16_step.applies(self, layers):
                logits = None if starts is None else cpu_bf16_step.step(self, tokens, positions, cache, rows, starts,
                                                                         column + 1, layers)
                if logits is not None:
                    return logits
                return self._head(cpu_bf16_step.layers(self, tokens, positions, attend, layers))
            return self._logits(self._layers(tokens, positions, attend))
        finally:
            self._step_ops = None

    def _kernel_supports(self, kernel, cache: KVCache) -> bool:
        """``kernel.supports(cache)``, asked once per cache (a generate call's: its tensors are written in place)."""
        memo = self._kernel_reads
        if memo is None or memo[0]() is not cache or memo[1] is not kernel:
            memo = self._kernel_reads = (weakref.ref(cache), kernel, kernel.supports(cache))
        return memo[2]

    def decode_static(self, buf) -> None:
        """decode() on fixed-shape buffers (static_decode.StepBuffers), capturable as a CUDA graph.

        Feeds ``buf.tokens`` at ``buf.positions``, writes their K/V into cache column ``buf.column`` (marking it valid
        in ``buf.key_valid``), attends over the whole cache length under that mask and writes fp32 logits into
        ``buf.logits``. Shapes and addresses never change between calls; the values in the buffers do.
        """
        s = self.shape
        rows, length = buf.key_valid.shape
        kv, D, G = s.num_kv_heads, s.head_dim, s.num_heads // s.num_kv_heads
        buf.key_valid.index_fill_(1, buf.column, True)
        biases = {}
        for window in s.windows:
            valid = buf.key_valid
            if window is not None:  # keys less than `window` columns before the one written now
                valid = valid & (torch.arange(length, device=self.device) > buf.column - window)[None]
            bias = torch.zeros(rows, length, dtype=self.dtype, device=self.device).masked_fill_(~valid, float("-inf"))
            biases[window] = bias[:, None, :].expand(rows, kv, length).reshape(rows * kv, 1, length)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            buf.keys[li].index_copy_(2, buf.column, k.unsqueeze(2))
            buf.values[li].index_copy_(2, buf.column, v.unsqueeze(2))
            keys = buf.keys[li].view(rows * kv, length, D).transpose(1, 2)
            if s.attn_softcap is None:
                scores = torch.baddbmm(biases[s.layers[li].window], q.reshape(rows * kv, G, D), keys,
                                       alpha=s.attention_scale)
            else:
                scores = torch.bmm(q.reshape(rows * kv, G, D), keys) * s.attention_scale
                scores = softcap_scores(scores, s.attn_softcap) + biases[s.layers[li].window]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.bmm(probs, buf.values[li].view(rows * kv, length, D)).view(rows, self.q_size)

        buf.logits.copy_(self._logits(self._layers(buf.tokens, buf.positions, attend)))
