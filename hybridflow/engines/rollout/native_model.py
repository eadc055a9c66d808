"""The decoder the native rollout runs: Qwen2 / Llama forward passes written for generation, on HF checkpoint weights.

Same arithmetic as transformers' modeling_qwen2 / modeling_llama (RMSNorm in fp32, rotate-half rotary embeddings,
grouped-query attention, SwiGLU MLP) so fp32 greedy decoding picks the same tokens. Differences are for speed:
  * q/k/v projections are one fused matrix ``w_qkv`` and gate/up one ``w_gate_up``; incoming HF tensors are copied
    into slices of them (``load``), so a weight update never rebuilds anything;
  * the KV cache is pre-allocated and written in place, each prompt's part stored once for its n samples
    (kv_cache.py, which also holds the decode attention);
  * a decode step is 2-D ``[rows, hidden]`` end to end;
  * decode attention is batched matmuls and one softmax: for one query per row, torch's CPU flash-attention kernel
    was 2-3x slower than that (measured at 64 rows);
  * on CPU the matmul weights are packed once into a kernel's own layout and re-packed lazily after a weight update:
    fp32 -> oneDNN's blocked layout (onednn_linear.py; same arithmetic, ~1.6x faster layer matmuls at 64 rows of the
    mid model; by default only from hidden size 256 up, below which it was slower), or,
    with ``int8=True``, int8 weights for the layer matmuls (int8_linear.py; embeddings, norms, attention, the KV
    cache and the output head stay in ``dtype``). The packed copies cost a second copy of the weights' memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.engines.rollout.int8_linear import check_int8_supported, int8_linear, pack_int8
from hybridflow.engines.rollout.kv_cache import KVCache, RunningRows, attention_bias, decode_attention
from hybridflow.engines.rollout.onednn_linear import MIN_PACKED_WIDTH, onednn_available, onednn_linear, pack_onednn

__all__ = ["DecoderShape", "NativeDecoder"]

SUPPORTED_ARCHITECTURES = ("qwen2", "llama")
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class DecoderShape:
    """The numbers of a checkpoint's config that the forward pass needs."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_config(cls, config) -> DecoderShape:
        arch = getattr(config, "model_type", None)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"the native rollout supports {list(SUPPORTED_ARCHITECTURES)} checkpoints, got model_type={arch!r}; "
                "use the 'hf' rollout engine for other architectures"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"native rollout: hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise ValueError("native rollout: sliding-window attention layers are not supported; use the 'hf' engine")
        num_heads = int(config.num_attention_heads)
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // num_heads),
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else attention_bias,  # Qwen2 always has q/k/v biases
            o_bias=False if arch == "qwen2" else attention_bias,
            mlp_bias=False if arch == "qwen2" else bool(getattr(config, "mlp_bias", False)),
        )


def rotary_tables(config, head_dim: int, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim] in fp32, computed exactly as transformers' rotary embedding does."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    elif rope_type in ("dynamic", "longrope"):
        raise ValueError(f"native rollout: rope_type={rope_type!r} depends on the sequence length; use the 'hf' engine")
    else:  # static scalings (linear, llama3, yarn, ...) come from transformers' own table
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, cast back, then scale. torch's fused rms_norm gave bitwise-equal
    fp32 results and ran 1.3x faster than the four-op form (measured at [64, 512])."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, x*cos + rotate_half(x)*sin, with rotate_half(x) = roll(x)*sign folded into signed_sin.

    Bitwise equal to transformers' form: (-a)*b == a*(-b) in IEEE arithmetic.
    """
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)


class NativeDecoder:
    """Weights of one Qwen2/Llama checkpoint in fused, generation-friendly tensors, plus prefill and decode steps."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device, max_positions: int, int8: bool = False,
                 prepack: bool | None = None):
        self.shape = s = DecoderShape.from_config(config)
        if prepack is None:  # auto: where it was measured to pay (onednn_linear.MIN_PACKED_WIDTH)
            prepack = s.hidden_size >= MIN_PACKED_WIDTH
        if int8:
            check_int8_supported(device)
            self.matmul = "int8"
        elif prepack and device.type == "cpu" and dtype == torch.float32 and onednn_available():
            self.matmul = "onednn"
        else:
            self.matmul = "dense"  # F.linear on the fused tensors (GPUs, bf16, small models, or prepack=False)
        self._packed: dict | None = None  # packed weights; None = (re)build before the next forward
        self.dtype, self.device = dtype, device
        self.q_size = s.num_heads * s.head_dim
        self.kv_size = s.num_kv_heads * s.head_dim

        def empty(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

        self.embed = empty(s.vocab_size, s.hidden_size)
        self.norm = empty(s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else empty(s.vocab_size, s.hidden_size)
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for _ in range(s.num_layers):
            self.layers.append(
                {
                    "input_layernorm": empty(s.hidden_size),
                    "post_attention_layernorm": empty(s.hidden_size),
                    "w_qkv": empty(self.q_size + 2 * self.kv_size, s.hidden_size),
                    "b_qkv": empty(self.q_size + 2 * self.kv_size) if s.qkv_bias else None,
                    "w_o": empty(s.hidden_size, self.q_size),
                    "b_o": empty(s.hidden_size) if s.o_bias else None,
                    "w_gate_up": empty(2 * s.intermediate_size, s.hidden_size),
                    "b_gate_up": empty(2 * s.intermediate_size) if s.mlp_bias else None,
                    "w_down": empty(s.hidden_size, s.intermediate_size),
                    "b_down": empty(s.hidden_size) if s.mlp_bias else None,
                }
            )
        cos, sin = rotary_tables(config, s.head_dim, max_positions, device)
        half = s.head_dim // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.cos, self.sin = cos.to(dtype), signed_sin.to(dtype)  # HF casts cos/sin to the activation dtype
        self.max_positions = max_positions

    # ------------------------------------------------------------------ weights
    def expected_names(self) -> set[str]:
        """The HF parameter names a full checkpoint of this shape must provide."""
        s = self.shape
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not s.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names.add(f"{p}self_attn.{proj}.weight")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names.add(f"{p}mlp.{proj}.weight")
            if s.qkv_bias:
                names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
            if s.o_bias:
                names.add(f"{p}self_attn.o_proj.bias")
            if s.mlp_bias:
                names |= {f"{p}mlp.{x}_proj.bias" for x in ("gate", "up", "down")}
        return names

    def _slot(self, name: str) -> torch.Tensor | None:
        """The tensor (or slice of a fused tensor) that HF parameter `name` lives in; None for ignored buffers."""
        if name == "model.embed_tokens.weight":
            return self.embed
        if name == "model.norm.weight":
            return self.norm
        if name == "lm_head.weight":
            return self.lm_head  # the embedding itself when tied: an update carries equal values under both names
        if name.endswith("rotary_emb.inv_freq"):
            return None
        match = _LAYER_NAME.fullmatch(name)
        if match is None or int(match.group(1)) >= self.shape.num_layers:
            return self._unknown(name)
        layer, rest = self.layers[int(match.group(1))], match.group(2)
        kind = "w" if rest.endswith(".weight") else "b"
        q, kv, inter = self.q_size, self.kv_size, self.shape.intermediate_size
        slices = {
            "self_attn.q_proj": ("qkv", 0, q),
            "self_attn.k_proj": ("qkv", q, q + kv),
            "self_attn.v_proj": ("qkv", q + kv, q + 2 * kv),
            "self_attn.o_proj": ("o", None, None),
            "mlp.gate_proj": ("gate_up", 0, inter),
            "mlp.up_proj": ("gate_up", inter, 2 * inter),
            "mlp.down_proj": ("down", None, None),
        }
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return layer[rest.removesuffix(".weight")]
        module = rest.rsplit(".", 1)[0]
        if module not in slices:
            return self._unknown(name)
        fused, start, stop = slices[module]
        target = layer[f"{kind}_{fused}"]
        if target is None:
            raise ValueError(f"native rollout: got {name!r} but this {self.shape.arch} config has no such bias")
        return target if start is None else target[start:stop]

    def _unknown(self, name: str):
        raise KeyError(
            f"native rollout: unknown parameter {name!r}; expected HF names such as 'model.layers.0.self_attn.q_proj"
            ".weight' (strip wrapper prefixes like '_orig_mod.' or '_fsdp_wrapped_module.' before sending)"
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
        slot.copy_(tensor.detach())
        self._packed = None
        return True

    def _pack_all(self) -> dict:
        names = ("qkv", "o", "gate_up", "down")
        if self.matmul == "int8":  # the output head stays in fp32
            layers = [{n: pack_int8(layer[f"w_{n}"], layer[f"b_{n}"]) for n in names} for layer in self.layers]
            return {"layers": layers, "lm_head": None}
        layers = [{n: pack_onednn(layer[f"w_{n}"]) for n in names} for layer in self.layers]
        return {"layers": layers, "lm_head": pack_onednn(self.lm_head)}

    def _packed_weights(self) -> dict:
        if self._packed is None:
            self._packed = self._pack_all()
        return self._packed

    def _linear(self, li: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """One of layer li's projections ('qkv', 'o', 'gate_up', 'down') applied to x [..., in]."""
        layer = self.layers[li]
        if self.matmul == "dense":
            return F.linear(x, layer[f"w_{name}"], layer[f"b_{name}"])
        packed = self._packed_weights()["layers"][li][name]
        if self.matmul == "int8":
            return int8_linear(x, packed)
        return onednn_linear(x, packed, layer[f"b_{name}"])

    # ------------------------------------------------------------------ forward
    def _mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(li, "gate_up", x).chunk(2, dim=-1)
        return self._linear(li, "down", F.silu(gate).mul_(up))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(h, self.norm, self.shape.rms_norm_eps)
        if self.matmul == "onednn":
            return onednn_linear(h, self._packed_weights()["lm_head"], None)
        return F.linear(h, self.lm_head).float()

    def prefill(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """Run the unique prompts [B, P] once and write their K/V into the cache's prompt part (shared by samples).

        Returns fp32 logits of the last prompt position [B, V].
        """
        s = self.shape
        B, P = input_ids.shape
        G = s.num_heads // s.num_kv_heads
        key_valid = attention_mask.bool()
        causal = torch.ones(P, P, dtype=torch.bool, device=input_ids.device).tril()
        # A padding query attends to itself so that its (unused) output stays finite instead of NaN.
        eye = torch.eye(P, dtype=torch.bool, device=input_ids.device)
        mask = ((causal[None] & key_valid[:, None, :]) | eye[None])[:, None]  # [B, 1, P, P]
        cos, sin = self.cos[position_ids][:, None], self.sin[position_ids][:, None]  # [B, 1, P, D]
        x = F.embedding(input_ids, self.embed)
        for li, layer in enumerate(self.layers):
            h = _rms_norm(x, layer["input_layernorm"], s.rms_norm_eps)
            qkv = self._linear(li, "qkv", h)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = _rotate(q.view(B, P, s.num_heads, s.head_dim).transpose(1, 2), cos, sin)
            k = _rotate(k.view(B, P, s.num_kv_heads, s.head_dim).transpose(1, 2), cos, sin)
            v = v.view(B, P, s.num_kv_heads, s.head_dim).transpose(1, 2)
            cache.write_prompts(li, k, v)
            attn = F.scaled_dot_product_attention(
                q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), attn_mask=mask, scale=s.head_dim**-0.5
            )
            attn = attn.transpose(1, 2).reshape(B, P, self.q_size)
            x = x + self._linear(li, "o", attn)
            x = x + self._mlp(li, _rms_norm(x, layer["post_attention_layernorm"], s.rms_norm_eps))
        return self._logits(x[:, -1])

    def _decode_layers(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The layers of one decode step for rows [r]; returns fp32 logits [r, V].

        ``attend(layer, q [r, kv, G, D], k [r, kv, D], v [r, kv, D]) -> [r, kv, G, D]`` stores the new K/V and
        attends: the only part in which the eager and the fixed-shape step differ.
        """
        s = self.shape
        r = tokens.shape[0]
        G = s.num_heads // s.num_kv_heads
        heads = s.num_heads + s.num_kv_heads  # q and k heads, rotated together
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [r, 1, D]
        x = F.embedding(tokens, self.embed)
        for li, layer in enumerate(self.layers):
            h = _rms_norm(x, layer["input_layernorm"], s.rms_norm_eps)
            qkv = self._linear(li, "qkv", h)
            qk = _rotate(qkv[:, : self.q_size + self.kv_size].view(r, heads, s.head_dim), cos, sin)
            v = qkv[:, self.q_size + self.kv_size :].view(r, s.num_kv_heads, s.head_dim)
            q = qk[:, : s.num_heads].view(r, s.num_kv_heads, G, s.head_dim)
            attn = attend(li, q, qk[:, s.num_heads :], v)
            x = x + self._linear(li, "o", attn.reshape(r, self.q_size))
            x = x + self._mlp(li, _rms_norm(x, layer["post_attention_layernorm"], s.rms_norm_eps))
        return self._logits(x)

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: RunningRows,
        prompt_bias: torch.Tensor, column: int
    ) -> torch.Tensor:
        """One step for the running rows. tokens, positions [rows]; prompt_bias [rows, P] (0, or -inf at the prompt's
        left padding). Writes the K/V of generated token `column` and returns fp32 logits [rows, V].
        """
        bias = attention_bias(cache, prompt_bias, column + 1)
        scale = self.shape.head_dim**-0.5

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write_token(li, column, k, v)
            return decode_attention(q, cache, li, rows, bias, column + 1, scale)

        return self._decode_layers(tokens, positions, attend)

    def decode_static(self, buf) -> None:
        """decode() on fixed-shape buffers (static_decode.StepBuffers), capturable as a CUDA graph.

        Feeds ``buf.tokens`` at ``buf.positions``, writes their K/V into cache column ``buf.column`` (marking it valid
        in ``buf.key_valid``), attends over the whole cache length under that mask and writes fp32 logits into
        ``buf.logits``. Shapes and addresses never change between calls; the values in the buffers do.
        """
        rows, length = buf.key_valid.shape
        kv, D = self.shape.num_kv_heads, self.shape.head_dim
        buf.key_valid.index_fill_(1, buf.column, True)
        bias = torch.zeros(rows, length, dtype=self.dtype, device=self.device).masked_fill_(~buf.key_valid, float("-inf"))
        bias = bias[:, None, :].expand(rows, kv, length).reshape(rows * kv, 1, length)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            buf.keys[li].index_copy_(2, buf.column, k.unsqueeze(2))
            buf.values[li].index_copy_(2, buf.column, v.unsqueeze(2))
            G = q.shape[2]
            scores = torch.baddbmm(bias, q.reshape(rows * kv, G, D),
                                   buf.keys[li].view(rows * kv, length, D).transpose(1, 2), alpha=D**-0.5)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.bmm(probs, buf.values[li].view(rows * kv, length, D))

        buf.logits.copy_(self._decode_layers(buf.tokens, buf.positions, attend))
