"""How each architecture the native rollout runs differs from the plain pre-norm decoder, as data.

The native decoder (native_model.py) is one forward pass: embed -> N x [norm, attention, residual, norm, gated MLP,
residual] -> norm -> output head. An architecture is an ``ArchSpec``: which of that pass's options it takes (q/k norm,
Gemma's (1 + weight) norms and its extra norms around the attention and MLP outputs, embedding scaling, the attention
scale, attention-score and logit soft-capping, the MLP activation, dense or routed-expert MLP (moe.py), which layers
use a sliding window, which layers have no position embedding) and how its HF parameter names map onto the
decoder's fused tensors. The rotary embedding (default, scaled like Llama 3's ``rope_type=llama3``, per layer type,
partial, longrope) is read from the config's ``rope_parameters`` by rope.py for every architecture alike; a layer
without one (SmolLM3's NoPE layers) rotates by the identity table ``NO_ROPE``. ``resolve`` reads one checkpoint's
config through its spec into the numbers the forward pass needs (``DecoderShape``).

Adding an architecture = one ``ArchSpec`` in ``ARCHITECTURES`` (plus its test in tests/engines/test_native_archs.py).
The values come from transformers' own modeling files (models/<arch>/modeling_<arch>.py); each spec says where it
differs from Llama.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ARCHITECTURES", "NO_ROPE", "ArchSpec", "DecoderShape", "LayerShape", "resolve", "supported_architectures"]

# LayerShape.rope of a layer without a position embedding: rope.py gives it cos 1 and sin 0, so every decode path
# (eager, the C step, bf16, CUDA graphs, tensor-parallel) leaves its q and k exactly as they are
NO_ROPE = "none"

# HF module name inside a layer -> (fused decoder tensor, part of it). Parts are q/k/v of "qkv" and gate/up of
# "gate_up"; None: the whole tensor. Llama's layout; Phi-3 stores q/k/v and gate/up already fused.
SEPARATE_PROJECTIONS = (
    ("self_attn.q_proj", ("qkv", "q")),
    ("self_attn.k_proj", ("qkv", "k")),
    ("self_attn.v_proj", ("qkv", "v")),
    ("self_attn.o_proj", ("o", None)),
    ("mlp.gate_proj", ("gate_up", "gate")),
    ("mlp.up_proj", ("gate_up", "up")),
    ("mlp.down_proj", ("down", None)),
)
FUSED_PROJECTIONS = (
    ("self_attn.qkv_proj", ("qkv", None)),  # rows [q | k | v], the decoder's own order
    ("self_attn.o_proj", ("o", None)),
    ("mlp.gate_up_proj", ("gate_up", None)),  # rows [gate | up]: Phi3MLP chunks gate first
    ("mlp.down_proj", ("down", None)),
)

# The MLP activations the decoder knows: config value -> torch.nn.functional call (native_model.py).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class ArchSpec:
    """One transformers ``model_type``'s decoder, as options of the native forward pass.

    Bias flags are True/False or the name of the config attribute that decides them.
    """

    model_type: str
    name_map: tuple[tuple[str, tuple[str, str | None]], ...] = SEPARATE_PROJECTIONS
    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    mlp_bias: bool | str = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before the rotary embedding (self_attn.q_norm/k_norm)
    norm_offset: float = 0.0  # Gemma: every RMSNorm multiplies by (offset + weight)
    sandwich_norms: bool = False  # Gemma: norm the attention and MLP outputs too (post_attention_layernorm is then
    # on the attention output, pre_feedforward_layernorm before the MLP, post_feedforward_layernorm after it)
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    activation_key: str = "hidden_act"
    query_scale_key: str | None = None  # Gemma: scores scaled by config.<key> ** -0.5 instead of head_dim ** -0.5
    final_softcap_key: str | None = None  # Gemma: logits = cap * tanh(logits / cap) with cap = config.<key>
    attn_softcap_key: str | None = None  # Gemma 2: attention scores = cap * tanh(scores / cap), before the mask
    # Which layers slide: "layer_types" (config.layer_types names them), "all" (every layer when
    # config.sliding_window is set), "none".
    sliding: str = "none"
    # A config flag that must be true for any layer to slide (SmolLM3's attention reads use_sliding_window itself)
    sliding_switch: str | None = None
    # A config list with one entry per layer, 0 where the layer has no rotary embedding (SmolLM3's no_rope_layers)
    rope_layers_key: str | None = None
    # Mixture-of-experts MLP (Qwen3-MoE): a top-k router (mlp.gate) over config.num_experts experts on the layers
    # that config.decoder_sparse_step / mlp_only_layers make sparse; the other layers keep the dense MLP.
    moe: bool = False

    @property
    def projections(self) -> dict[str, tuple[str, str | None]]:
        """HF module name in a layer -> (fused tensor, part)."""
        return dict(self.name_map)

    @property
    def layer_norms(self) -> tuple[str, ...]:
        names = ("input_layernorm", "post_attention_layernorm")
        if self.sandwich_norms:
            names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        if self.qk_norm:
            names += ("self_attn.q_norm", "self_attn.k_norm")
        return names


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        # Qwen2: q/k/v biases always, none on o_proj or the MLP; sliding layers when use_sliding_window.
        ArchSpec("qwen2", qkv_bias=True, o_bias=False, sliding="layer_types"),
        # Qwen3: Qwen2 without the forced biases, plus RMSNorm on each q and k head.
        ArchSpec("qwen3", qk_norm=True, sliding="layer_types"),
        # Llama (2, 3, 3.1+ with rope_type=llama3): the baseline.
        ArchSpec("llama", mlp_bias="mlp_bias"),
        # Mistral: no biases; every layer slides when config.sliding_window is set.
        ArchSpec("mistral", qkv_bias=False, o_bias=False, sliding="all"),
        # Gemma 2: Gemma's (1 + w) norms, four norms per layer, scaled embeddings, GELU-tanh, query_pre_attn_scalar,
        # soft-capped attention scores and logits, alternating sliding/global layers.
        ArchSpec("gemma2", norm_offset=1.0, sandwich_norms=True, scale_embeddings=True,
                 activation_key="hidden_activation", query_scale_key="query_pre_attn_scalar",
                 final_softcap_key="final_logit_softcapping", attn_softcap_key="attn_logit_softcapping",
                 sliding="layer_types"),
        # Gemma 3 (text): (1 + w) norms everywhere, q/k norm, four norms per layer, scaled embeddings, GELU-tanh,
        # query_pre_attn_scalar, final soft-capping, sliding/global layers with their own rope each. Its modeling file
        # never applies attn_logit_softcapping (the attention call gets no softcap), so neither does the decoder.
        ArchSpec("gemma3_text", qk_norm=True, norm_offset=1.0, sandwich_norms=True, scale_embeddings=True,
                 activation_key="hidden_activation", query_scale_key="query_pre_attn_scalar",
                 final_softcap_key="final_logit_softcapping", sliding="layer_types"),
        # Qwen3-MoE: Qwen3's attention with routed experts (no shared expert); every layer slides when
        # use_sliding_window.
        ArchSpec("qwen3_moe", qk_norm=True, sliding="all", moe=True),
        # Phi-3: fused qkv_proj and gate_up_proj, no biases, partial rotary / longrope from rope_parameters.
        ArchSpec("phi3", name_map=FUSED_PROJECTIONS, qkv_bias=False, o_bias=False, sliding="all"),
        # SmolLM3: Llama with no rotary embedding on the layers config.no_rope_layers marks 0 (every fourth), and
        # sliding layers only while use_sliding_window is set.
        ArchSpec("smollm3", mlp_bias="mlp_bias", sliding="layer_types", sliding_switch="use_sliding_window",
                 rope_layers_key="no_rope_layers"),
    )
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


@dataclass(frozen=True)
class LayerShape:
    """Per-layer attention choices: the rope table it uses and its sliding window (None: full attention)."""

    rope: str  # key of the decoder's rotary tables: "default", the layer type when rope differs per type, NO_ROPE
    window: int | None
    moe: bool = False  # routed experts instead of the dense MLP


@dataclass(frozen=True)
class DecoderShape:
    """The numbers of a checkpoint's config that the forward pass needs, read through its ArchSpec."""

    arch: str
    spec: ArchSpec
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
    activation: str
    attention_scale: float
    final_softcap: float | None
    attn_softcap: float | None
    embed_scale: float | None
    layers: tuple[LayerShape, ...] = field(default=())
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1

    @property
    def windows(self) -> set[int | None]:
        return {layer.window for layer in self.layers}

    @property
    def moe(self) -> bool:
        return any(layer.moe for layer in self.layers)


def _flag(config, value: bool | str) -> bool:
    return bool(getattr(config, value, False)) if isinstance(value, str) else bool(value)


def _layer_types(config, spec: ArchSpec) -> list[str]:
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if spec.sliding == "layer_types":
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    elif spec.sliding == "all":
        types = ["sliding_attention" if window is not None else "full_attention"] * n
    else:
        types = ["full_attention"] * n
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise ValueError(f"native rollout: this {spec.model_type} config names sliding-attention layers, which "
                             f"its transformers model does not have; fix config.layer_types")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"native rollout: config.layer_types={types} must list {n} of 'full_attention' / "
                         "'sliding_attention'; other attention kinds need the 'hf' engine "
                         "(actor_rollout_ref.rollout.name=hf)")
    if "sliding_attention" in types and not window:
        raise ValueError("native rollout: sliding-attention layers but config.sliding_window is not set")
    if "sliding_attention" in types and spec.sliding_switch and not getattr(config, spec.sliding_switch, False):
        # the attention would not slide but transformers' mask for these layers would: refuse the contradiction
        raise ValueError(f"native rollout: config.layer_types names sliding-attention layers but "
                         f"{spec.sliding_switch} is false; set both or neither")
    return types


def _rotary_layers(config, spec: ArchSpec) -> list[bool]:
    """Per layer, whether it applies the rotary embedding (all, unless spec.rope_layers_key marks some 0)."""
    n = int(config.num_hidden_layers)
    if spec.rope_layers_key is None:
        return [True] * n
    flags = getattr(config, spec.rope_layers_key, None)
    if flags is None or len(flags) != n or any(f not in (0, 1, True, False) for f in flags):
        raise ValueError(f"native rollout: config.{spec.rope_layers_key}={flags} must give each of the {n} layers "
                         "1 (rotary embedding) or 0 (none)")
    return [bool(f) for f in flags]


def resolve(config) -> DecoderShape:
    """``config`` (a transformers PretrainedConfig) -> DecoderShape; a clear error for what the decoder cannot run."""
    arch = getattr(config, "model_type", None)
    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise ValueError(
            f"the native rollout engine does not know model_type={arch!r}; it runs {supported_architectures()}. "
            "Use the transformers rollout instead: actor_rollout_ref.rollout.name=hf (it runs any causal LM, slower)"
        )
    activation = getattr(config, spec.activation_key, "silu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"native rollout: {arch} config has {spec.activation_key}={activation!r}; the decoder knows "
                         f"{list(ACTIVATIONS)}. Use actor_rollout_ref.rollout.name=hf")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("native rollout: use_bidirectional_attention=True is not a causal decoder; use the 'hf' engine")
    num_heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    scale = head_dim**-0.5 if spec.query_scale_key is None else float(getattr(config, spec.query_scale_key)) ** -0.5
    types = _layer_types(config, spec)
    window = getattr(config, "sliding_window", None)
    per_type_rope = _rope_per_layer_type(config)
    rotary = _rotary_layers(config, spec)
    sparse = _sparse_layers(config, spec)
    layers = tuple(
        LayerShape(rope=(t if per_type_rope else "default") if rotary[i] else NO_ROPE,
                   window=int(window) if t == "sliding_attention" else None, moe=i in sparse)
        for i, t in enumerate(types)
    )
    softcap = getattr(config, spec.final_softcap_key, None) if spec.final_softcap_key else None
    attn_softcap = getattr(config, spec.attn_softcap_key, None) if spec.attn_softcap_key else None
    return DecoderShape(
        arch=arch,
        spec=spec,
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=_flag(config, spec.qkv_bias),
        o_bias=_flag(config, spec.o_bias),
        mlp_bias=_flag(config, spec.mlp_bias),
        activation=activation,
        attention_scale=scale,
        final_softcap=float(softcap) if softcap else None,
        attn_softcap=float(attn_softcap) if attn_softcap else None,
        embed_scale=float(config.hidden_size) ** 0.5 if spec.scale_embeddings else None,
        layers=layers,
        num_experts=int(getattr(config, "num_experts", 0) or 0) if sparse else 0,
        experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0) if sparse else 0,
        moe_intermediate_size=int(getattr(config, "moe_intermediate_size", 0) or 0) if sparse else 0,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
    )


def _sparse_layers(config, spec: ArchSpec) -> set[int]:
    """Indices of the MoE layers, by Qwen3MoeDecoderLayer's rule."""
    if not spec.moe or int(getattr(config, "num_experts", 0) or 0) <= 0:
        return set()
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return {i for i in range(int(config.num_hidden_layers)) if i not in dense and (i + 1) % step == 0}


def _rope_per_layer_type(config) -> bool:
    """Gemma 3 style: rope_parameters keyed by layer type, each layer type with its own rope."""
    params = getattr(config, "rope_parameters", None) or {}
    return bool(params) and all(isinstance(v, dict) for v in params.values()) and "rope_type" not in params
