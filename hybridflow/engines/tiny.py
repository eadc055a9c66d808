"""Write small random-init models and a character-level tokenizer to disk, for tests, examples and benchmarks.

Everything is saved with ``save_pretrained`` and loaded back by path with the ordinary transformers code, so the
code under test is the code a user runs on a real checkpoint. No hub downloads.
"""

from __future__ import annotations

import dataclasses
import os
import string
from dataclasses import dataclass

import torch

from hybridflow.common.files import umask_modes

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|im_start|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]

# A ChatML-style template: the assistant turn ends with <|im_end|>, which is also the eos token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def char_vocab() -> list[str]:
    """Special tokens, then one token per byte, written in the byte-level alphabet (" " is "Ġ", "\\n" is "Ċ").

    The byte-level form makes the same tokenizer.json load identically through every transformers tokenizer class
    (Qwen2's tokenizer rebuilds a byte-level pipeline around the saved vocabulary), and any UTF-8 text encodes.
    """
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    printable = [ch for ch in string.printable if ch not in "\x0b\x0c\r"]
    byte_map = _bytes_to_unicode()
    first = [byte_map[ord(ch)] for ch in printable]  # ASCII first so small ids are readable characters
    rest = sorted(set(alphabet) - set(first))
    return SPECIAL_TOKENS + first + rest


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-to-unicode table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_char_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A transformers fast tokenizer that maps each character to one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(char_vocab())}
    # BPE without merges over the byte alphabet: one token per byte (per character for ASCII).
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        hf_tok.chat_template = chat_template
    return hf_tok


# Architectures a tiny model can be written in (transformers model_type names; all run on the native rollout).
TINY_ARCHITECTURES = ("qwen2", "qwen3", "qwen3_moe", "llama", "mistral", "gemma2", "gemma3_text", "phi3", "smollm3")


@dataclass
class TinyModelSpec:
    """Shape of a small decoder-only model. The defaults give a ~0.4M-parameter model for unit tests."""

    arch: str = "qwen2"  # one of TINY_ARCHITECTURES
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int | None = None  # default: 4 * hidden_size rounded
    vocab_size: int = 288
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    # Sliding-window attention, where the architecture has it (qwen2/qwen3: on the layers from max_window_layers
    # up; mistral/phi3: every layer). Gemma 3 always has it (default 64 here) on its sliding layers.
    sliding_window: int | None = None


# Named sizes used across tests and benchmarks.
SIZES = {
    "unit": TinyModelSpec(),
    "tiny": TinyModelSpec(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
    "small": TinyModelSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2),
    # ~21M parameters: the "mid" size of the benchmarks.
    "mid": TinyModelSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536),
}


def make_config(spec: TinyModelSpec, tokenizer=None):
    """The transformers config class of ``spec.arch`` with the spec's shape (random-init models are built from it)."""
    import transformers

    inter = spec.intermediate_size or 4 * spec.hidden_size
    head_dim = spec.hidden_size // spec.num_heads
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=inter,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-6,
    )
    # Phi-3's config defaults name token ids past a tiny vocabulary: always set them
    ids = (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) if tokenizer is not None else (
        None, None, None)
    common.update(pad_token_id=ids[0], eos_token_id=ids[1], bos_token_id=ids[2])
    window = spec.sliding_window
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if spec.arch in ("qwen2", "qwen3"):
        extra = dict(rope_parameters=rope, use_sliding_window=window is not None, sliding_window=window,
                     max_window_layers=spec.num_layers // 2)
        if spec.arch == "qwen3":
            extra["head_dim"] = head_dim  # Qwen3's config default is 128
        cls = transformers.Qwen2Config if spec.arch == "qwen2" else transformers.Qwen3Config
        return cls(**common, **extra)
    if spec.arch == "qwen3_moe":
        # 4 experts, 2 per token, renormalised router weights (as Qwen3-30B-A3B), experts half the dense width
        return transformers.Qwen3MoeConfig(
            **common, head_dim=head_dim, rope_parameters=rope, use_sliding_window=window is not None,
            sliding_window=window, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=inter // 2,
            norm_topk_prob=True,
        )
    if spec.arch == "llama":
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if spec.arch == "mistral":
        return transformers.MistralConfig(**common, rope_parameters=rope, sliding_window=window)
    if spec.arch == "phi3":
        return transformers.Phi3Config(**common, rope_parameters=rope, sliding_window=window,
                                       original_max_position_embeddings=spec.max_position_embeddings)
    if spec.arch == "gemma2":
        # alternating sliding/global layers; attention and logit soft-capping at Gemma 2's 50 and 30
        return transformers.Gemma2Config(
            **common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=window or 64,
            hidden_activation="gelu_pytorch_tanh", rope_parameters=rope,
        )
    if spec.arch == "gemma3_text":
        # Gemma 3's pattern: five sliding layers, then a global one; the last layer is global here so that a
        # two-layer model has one of each.
        types = ["full_attention" if (spec.num_layers - 1 - i) % 6 == 0 else "sliding_attention"
                 for i in range(spec.num_layers)]
        return transformers.Gemma3TextConfig(
            **common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=window or 64,
            layer_types=types, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        )
    if spec.arch == "smollm3":
        # SmolLM3-3B's pattern: every fourth layer has no rotary embedding; the last layer is one of those here so that
        # a two-layer model has one of each.
        no_rope = [int((spec.num_layers - 1 - i) % 4 != 0) for i in range(spec.num_layers)]
        return transformers.SmolLM3Config(**common, rope_parameters=rope, no_rope_layers=no_rope,
                                          use_sliding_window=window is not None, sliding_window=window)
    raise ValueError(f"unknown tiny-model architecture {spec.arch!r}; choose one of {list(TINY_ARCHITECTURES)}")


def write_tiny_model(
    path: str | os.PathLike,
    spec: TinyModelSpec | str = "unit",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    arch: str | None = None,
) -> str:
    """Write a random-init causal LM plus the character tokenizer to `path`; returns the path.

    `spec` is a TinyModelSpec or one of the names in SIZES; `arch` (one of TINY_ARCHITECTURES) replaces its arch.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(spec, str):
        if spec not in SIZES:
            raise ValueError(f"unknown tiny-model size {spec!r}; choose one of {sorted(SIZES)}")
        spec = SIZES[spec]
    if arch is not None:
        if arch not in TINY_ARCHITECTURES:
            raise ValueError(f"unknown tiny-model architecture {arch!r}; choose one of {list(TINY_ARCHITECTURES)}")
        spec = dataclasses.replace(spec, arch=arch)
    tokenizer = build_char_tokenizer()
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"vocab_size {spec.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = make_config(spec, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    umask_modes(os.fspath(path))  # safetensors writes 0600 (common/files.py)
    tokenizer.save_pretrained(path)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(path)
    return str(path)


def write_tiny_reward_model(
    path: str | os.PathLike, spec: TinyModelSpec | str = "unit", seed: int = 0, arch: str = "llama"
) -> str:
    """Write a random-init decoder ``...ForSequenceClassification`` with one label (a reward model: one scalar per
    sequence) plus the character tokenizer to `path`; returns the path."""
    from transformers import AutoModelForSequenceClassification

    spec = SIZES[spec] if isinstance(spec, str) else spec
    spec = dataclasses.replace(spec, arch=arch)
    tokenizer = build_char_tokenizer()
    config = make_config(spec, tokenizer)
    config.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    umask_modes(os.fspath(path))  # safetensors writes 0600 (common/files.py)
    tokenizer.save_pretrained(path)
    return str(path)
