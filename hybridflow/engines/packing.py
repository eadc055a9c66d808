"""True sequence packing: a micro-batch's rows laid end to end in one ``[1, T]`` row, attention kept per row.

The alternative to length bucketing (micro_batch.py). Bucketing pads every row of a micro-batch to its longest row;
packing concatenates the rows' real tokens (``T`` = their sum, no padding at all), restarts ``position_ids`` at each
row, and runs attention block-diagonally: each token attends causally to the tokens of its own row only.

Attention runs through ``hybridflow_varlen``, registered with transformers' ``AttentionInterface`` (so the
modeling code of any model built on that interface calls it) and given the row boundaries
``cu_seq_lens_q/k [b + 1]`` (int32) and ``max_length_q/k`` as forward kwargs, the names transformers' flash-attention
path reads. On CUDA with ``flash_attn`` installed it calls ``flash_attn_varlen_func``; elsewhere (CPU) it runs
PyTorch SDPA with ``is_causal=True`` once per distinct row length (the rows of one length as one batch), so it never
builds or computes a ``[T, T]`` score matrix (an SDPA block-diagonal mask over the packed row would cost ``T**2``
instead of ``sum(len**2)``), and hundreds of short rows do not cost hundreds of calls per layer. Its mask function
(`_mask_unless_packed`) builds no mask for a packed call and transformers' SDPA mask for any other, so a padded batch
through the same model is still masked.

Results equal the bucketed computation up to float rounding (tests/engines/test_packing.py checks log-probs and
gradients to 1e-5 in fp32).

With ``share_prompts`` (EngineConfig.share_prompts), rows of one prompt hold it once in the packed row, before their
responses, and the attention runs per group (shared_prompts.py).
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.engines import cpu_flash_attention
from hybridflow.engines.causal_attention import causal_attention
from hybridflow.engines.micro_batch import Bucket, build_bucket, real_token_spans
from hybridflow.engines.shared_prompts import SharedPrompts, shared_layout, shared_prompt_attention

__all__ = ["VARLEN_ATTENTION", "PackedBucket", "build_packed", "enable_packed_attention", "packing_refusal",
           "varlen_attention"]

VARLEN_ATTENTION = "hybridflow_varlen"


@dataclass
class PackedBucket(Bucket):
    """A `Bucket` whose ``input_ids`` / ``position_ids`` are ``[1, T]`` (rows end to end, positions restarting per
    row), ``select_rows`` all 0 and ``select_cols`` indices into T; ``cu_seq_lens [b + 1]`` int32 row boundaries."""

    cu_seq_lens: torch.Tensor | None = None
    max_length: int = 0
    shared: SharedPrompts | None = None

    def attention_kwargs(self) -> dict:
        """The forward kwargs `varlen_attention` (and transformers' flash-attention path) read."""
        if self.shared is not None:  # cu_seq_lens are the groups' bounds; the attention reads the groups
            return {"hybridflow_shared_prompts": self.shared, "cu_seq_lens_q": self.cu_seq_lens}
        return {
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }


# The last layout build_packed made: (its options, copies of the rows it was made from, the layout). A step's forward
# passes over one batch (reference, old log-probs, critic values, the update) see the same micro-batches in the same
# order, and at a small model's size laying one out costs as much as a tenth of its forward pass; the layout and
# what it caches (the attention's plan of the shared prompts) are only read after they are made.
_last_packed: list = [None]


def build_packed(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    pad_token_id: int = 0,
    share_prompts: bool = False,
) -> PackedBucket:
    """Padded rows ``[b, P+R]`` (one micro-batch, rollout layout) -> a `PackedBucket` of ``T = sum(real tokens)``;
    with `share_prompts`, rows of one prompt hold it once (shared_prompts.py) where any two rows share one. The
    same rows as the last call's (equal values) give the last call's layout."""
    options, rows = (response_length, pad_token_id, share_prompts), (input_ids, attention_mask, position_ids)
    last = _last_packed[0]
    if last is not None and last[0] == options and all(
            a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
            for a, b in zip(last[1], rows)):
        return last[2]
    packed = _build_packed(*rows, response_length, pad_token_id, share_prompts)
    _last_packed[0] = (options, tuple(t.clone() for t in rows), packed)
    return packed


def _build_packed(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  response_length: int, pad_token_id: int, share_prompts: bool) -> PackedBucket:
    stripped = build_bucket(input_ids, attention_mask, position_ids, response_length, True, pad_token_id)
    layout = shared_layout(input_ids, attention_mask, position_ids, response_length) if share_prompts else None
    if layout is not None:
        # response token t is predicted from its prompt's last position (t = 0) or from its own token t - 1
        rows, t = stripped.out_rows, stripped.out_cols
        select = torch.where(t == 0, layout["prompt_last"][rows], layout["response_start"][rows] + t - 1)
        return PackedBucket(
            input_ids=layout["input_ids"], position_ids=layout["position_ids"], attention_mask=None,
            select_rows=torch.zeros_like(stripped.select_rows), select_cols=select,
            target_ids=stripped.target_ids, out_rows=stripped.out_rows, out_cols=stripped.out_cols,
            cu_seq_lens=layout["cu_seq_lens"], max_length=layout["max_length"], shared=layout["shared"],
        )
    b, width = stripped.input_ids.shape
    starts, ends = real_token_spans(attention_mask)
    lens = ends - starts
    real = torch.arange(width, device=input_ids.device)[None, :] < lens[:, None]  # [b, width]
    offsets = torch.cumsum(lens, 0) - lens
    cu = torch.zeros(b + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
    return PackedBucket(
        input_ids=stripped.input_ids[real][None, :],
        position_ids=stripped.position_ids[real][None, :],
        attention_mask=None,
        select_rows=torch.zeros_like(stripped.select_rows),
        select_cols=offsets[stripped.select_rows] + stripped.select_cols,
        target_ids=stripped.target_ids,
        out_rows=stripped.out_rows,
        out_cols=stripped.out_cols,
        cu_seq_lens=cu,
        max_length=int(lens.max()),
    )


def packing_refusal(hf_config) -> str | None:
    """Why `varlen_attention` cannot run this model (None if it can): the start-up form of its forward-time check.

    transformers passes ``sliding_window`` to the attention of a layer typed ``sliding_attention`` (Qwen2/3,
    Gemma 2/3), and on every layer of a model without layer types when the config sets it (Mistral, Phi-3, Mixtral,
    Qwen3-MoE with use_sliding_window); Gemma 2 passes ``softcap``.
    """
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    sliding = [i for i, kind in enumerate(layer_types or []) if kind == "sliding_attention"]
    if sliding:
        return f"sliding-window attention (sliding_window={window}) on {len(sliding)} of its layers"
    if not layer_types and window:
        return f"sliding-window attention (sliding_window={window})"
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        return f"soft-capped attention logits (attn_logit_softcapping={hf_config.attn_logit_softcapping})"
    return None


def _flash_varlen():
    if not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None):
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]``, ``key/value [1, Hkv, T, D]`` -> ``[1, T, H, D]``.

    Block-diagonal causal attention over the rows ``cu_seq_lens_q`` delimits. Without ``cu_seq_lens_q`` (a call
    that is not packed, e.g. generation through the same model) every batch row is one sequence.
    """
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(
            f"{VARLEN_ATTENTION}: sliding-window / soft-capped attention is not supported by sequence packing; "
            "set use_sequence_packing=false for this model"
        )
    groups = getattr(module, "num_key_value_groups", 1)
    p = dropout if module.training else 0.0
    if cu_seq_lens_q is None:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=p, is_causal=attention_mask is None,
            scale=scaling, enable_gqa=groups > 1,
        )
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN_ATTENTION}: packed input must be one row [1, T], got batch {query.shape[0]}")
    shared = kwargs.get("hybridflow_shared_prompts")
    if getattr(module, "hybridflow_flash_attention", False) and cpu_flash_attention.takes(query, key, value, p):
        layout = cpu_flash_attention.rows_layout(cu_seq_lens_q) if shared is None else shared.flash_layout()
        if layout is not None:
            return cpu_flash_attention.packed_causal_attention(query, key, value, layout, scaling), None
    if shared is not None:
        return shared_prompt_attention(query, key, value, shared, p, scaling, groups), None
    flash = _flash_varlen() if query.is_cuda else None
    if flash is not None:
        # flash-attn's layout is [T, H, D]; it repeats no KV heads itself (GQA is native)
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        cu = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
        out = flash(q, k, v, cu, cu, max_length_q, max_length_q, dropout_p=p, softmax_scale=scaling, causal=True)
        return out[None], None
    spans = list(itertools.pairwise(cu_seq_lens_q.tolist()))
    starts_by_length: dict[int, list[int]] = {}
    for lo, hi in spans:
        starts_by_length.setdefault(hi - lo, []).append(lo)
    if len(starts_by_length) == len(spans):  # every row its own length: one call per row, no copies
        # split, not slices: a slice's backward fills a zero tensor of the whole packed row, once per row
        lengths = [hi - lo for lo, hi in spans]
        outs = [_causal(q, k, v, p, scaling, groups)
                for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)))]
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None
    return _causal_by_length(query, key, value, starts_by_length, p, scaling, groups), None


def _causal(q, k, v, p: float, scaling: float | None, groups: int) -> torch.Tensor:
    return causal_attention(q, k, v, p, scaling, groups > 1)


def _causal_by_length(query, key, value, starts_by_length: dict[int, list[int]], p: float, scaling: float | None,
                      groups: int) -> torch.Tensor:
    """Packed rows of equal length attended in one batched call per length ([1, H, T, D] -> [1, T, H, D]).

    Many short rows (a small model's GRPO batch: hundreds of rows of a few dozen tokens) would otherwise cost one
    attention call per row and layer; a batch of rows of one length is the same computation with no padding, so the
    number of calls drops to the number of distinct lengths. The rows' tokens are gathered per length, attended, and
    put back in packed order by one index.

    One gather for all lengths, then a split: a gather or a slice per length would each cost, in the backward, a
    zero-filled tensor of the whole packed row.
    """
    positions = [(torch.tensor(starts)[:, None] + torch.arange(length)).reshape(-1)
                 for length, starts in starts_by_length.items()]
    order = torch.cat(positions).to(query.device)
    sizes = [index.numel() for index in positions]
    gathered = (t.squeeze(0).index_select(1, order).split(sizes, dim=1) for t in (query, key, value))
    pieces = []
    for (length, starts), q, k, v in zip(starts_by_length.items(), *gathered):
        q, k, v = (t.unflatten(1, (len(starts), length)).transpose(0, 1) for t in (q, k, v))  # [rows, heads, len, D]
        pieces.append(_causal(q, k, v, p, scaling, groups).transpose(0, 1).flatten(1, 2))  # [heads, rows*length, D]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(pieces, dim=1).index_select(1, inverse).transpose(0, 1)[None].contiguous()


def _mask_unless_packed(*, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers mask function for `varlen_attention`: no mask for a packed call (it has no attention_mask; the
    rows are kept apart by cu_seq_lens, with no ``[T, T]`` mask), the SDPA mask for any other call, so that a padded
    batch through the same model (an export check, a plain forward) is masked as with transformers' sdpa."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def enable_packed_attention(hf_model: torch.nn.Module) -> str:
    """Switch a transformers model to `varlen_attention` (registered once, with its mask function); returns the
    implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _mask_unless_packed)
    hf_model.set_attn_implementation(VARLEN_ATTENTION)
    if getattr(hf_model.config, "_attn_implementation", None) != VARLEN_ATTENTION:
        raise ValueError(
            f"{type(hf_model).__name__} did not take the {VARLEN_ATTENTION} attention implementation (its modeling "
            "code does not use transformers' AttentionInterface); set use_sequence_packing=false for this model"
        )
    return VARLEN_ATTENTION
