"""Ulysses sequence parallelism for training: each of the ``sp`` ranks of a group holds ``L / sp`` tokens of every row.

Everything outside attention is per token, so it runs on the local piece unchanged (RoPE takes the piece's own
position ids). Around attention two all-to-alls swap the split (DeepSpeed-Ulysses):
``q, k, v [b, heads, L/sp, d] -> [b, heads/sp, L, d]`` (each rank gets whole sequences for a slice of the heads),
causal SDPA over the whole sequence, and back ``[b, heads/sp, L, d] -> [b, heads, L/sp, d]``. When the KV heads do
not split over ``sp`` they are repeated up to the query heads first (GQA sharing stays exact).

The output head runs only on the response positions inside a rank's own piece; the ``[N]`` results are gathered so
that every rank of the group holds the micro-batch's whole outputs and computes the same loss. The gather's backward
hands each rank the gradient of its own positions only (all ranks hold the same loss, so no reduction is needed), so
each rank's parameter gradient is the share of its piece and FSDP's sum over the SP ranks is the full gradient.

Gloo implements ``all_to_all_single`` (checked on torch 2.13), so the same code runs on CPU (gloo) and GPUs (nccl).
The stripped layout only (``use_remove_padding=True``): attention is plainly causal, rows are right-padded to a
multiple of ``sp``, and right padding cannot reach a real token under a causal mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.engines.hf_model import HeadOnPositions

__all__ = ["ATTENTION_NAME", "SP_ARCHITECTURES", "SequenceParallelHead", "check_sequence_parallel"]

ATTENTION_NAME = "hybridflow_ulysses"  # registered with transformers' AttentionInterface
# Gemma 2/3 soft-cap attention scores and slide windows, which plain causal SDPA cannot do.
SP_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "smollm3")


def check_sequence_parallel(hf_config, sp: int, tp: int = 1, where: str = "ulysses_sequence_parallel_size") -> None:
    """Start-up check that `sp` can split this model's heads (per TP rank); ValueError naming the numbers."""
    if sp == 1:
        return
    model_type = getattr(hf_config, "model_type", "?")
    if model_type not in SP_ARCHITECTURES:
        raise ValueError(
            f"{where}={sp}: sequence-parallel training supports model types {list(SP_ARCHITECTURES)}, this model "
            f"is {model_type!r}; use {where}=1"
        )
    if getattr(hf_config, "use_sliding_window", model_type == "mistral") and getattr(hf_config, "sliding_window", None):
        raise ValueError(
            f"{where}={sp}: the model uses sliding-window attention (sliding_window={hf_config.sliding_window}), "
            f"which Ulysses' causal attention does not apply; use {where}=1"
        )
    heads = hf_config.num_attention_heads // tp
    if heads % sp:
        raise ValueError(
            f"{where}={sp} does not divide the {heads} attention heads per tensor-parallel rank "
            f"(num_attention_heads={hf_config.num_attention_heads} / tensor_model_parallel_size={tp}); "
            f"choose a divisor of {heads}"
        )


class _AllToAll(torch.autograd.Function):
    """``x [sp, ...]``: piece j goes to rank j, piece i of the result came from rank i. Its own transpose, so the
    backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # the pieces arrive as a permuted view; the exchange reads and writes flat memory
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def heads_to_sequence(x: torch.Tensor, sp: int, group) -> torch.Tensor:
    """``[b, h, L/sp, d]`` (all heads, my piece) -> ``[b, h/sp, L, d]`` (my heads, whole sequence)."""
    b, h, n, d = x.shape
    pieces = x.reshape(b, sp, h // sp, n, d).permute(1, 0, 2, 3, 4)  # [sp (head slice), b, h/sp, n, d]
    got = _AllToAll.apply(pieces, group)  # [sp (sequence piece), b, h/sp, n, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * n, d)


def sequence_to_heads(x: torch.Tensor, sp: int, group) -> torch.Tensor:
    """``[b, h/sp, L, d]`` -> ``[b, h, L/sp, d]``: the inverse of `heads_to_sequence`."""
    b, hs, length, d = x.shape
    pieces = x.reshape(b, hs, sp, length // sp, d).permute(2, 0, 1, 3, 4)  # [sp (sequence piece), b, h/sp, n, d]
    got = _AllToAll.apply(pieces, group)  # [sp (head slice), b, h/sp, n, d]
    return got.permute(1, 0, 2, 3, 4).reshape(b, hs * sp, length // sp, d)


def ulysses_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      **kwargs):
    """transformers attention function: ``query [b, hq, L/sp, d]``, ``key/value [b, hkv, L/sp, d]`` ->
    ``([b, L/sp, hq, d], None)``; causal over the whole sequence (attention_mask is ignored: stripped layout)."""
    if sliding_window is not None:
        raise ValueError(f"Ulysses attention got sliding_window={sliding_window}; sliding windows are not supported")
    group, sp = module.hybridflow_sp_group, module.hybridflow_sp_size
    hq, hkv = query.shape[1], key.shape[1]
    if hkv % sp:  # too few KV heads to split: give every query head its own copy (what GQA computes anyway)
        key, value = key.repeat_interleave(hq // hkv, dim=1), value.repeat_interleave(hq // hkv, dim=1)
    q, k, v = (heads_to_sequence(t, sp, group) for t in (query, key, value))
    if k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling)
    return sequence_to_heads(out, sp, group).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)  # built by transformers, then ignored


class _GatherPositions(torch.autograd.Function):
    """Every rank's ``[n_r]`` values -> the group's ``[N]`` (rank r's at ``owner == r``, in order). Backward: this
    rank's positions of the (identical on every rank) gradient; nothing is summed."""

    @staticmethod
    def forward(ctx, mine: torch.Tensor, owner: torch.Tensor, rank: int, sp: int, group) -> torch.Tensor:
        counts = torch.bincount(owner, minlength=sp).tolist()
        width = max(counts) if counts else 0
        padded = mine.new_zeros(width)
        padded[: mine.shape[0]] = mine
        pieces = [torch.empty_like(padded) for _ in range(sp)]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        full = mine.new_empty(owner.shape[0])
        for r in range(sp):
            full[owner == r] = pieces[r][: counts[r]]
        ctx.save_for_backward(owner == rank)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (is_mine,) = ctx.saved_tensors
        return grad[is_mine], None, None, None, None


class SequenceParallelHead(HeadOnPositions):
    """`HeadOnPositions` over an SP group: same forward contract, each rank computing ``L / sp`` tokens."""

    def __init__(self, hf_model, is_critic: bool, group, sp_size: int, sp_rank: int) -> None:
        super().__init__(hf_model, is_critic)
        _register()
        hf_model.set_attn_implementation(ATTENTION_NAME)
        backbone = getattr(hf_model, hf_model.base_model_prefix)
        for layer in backbone.layers:
            # the attention function finds its group on the module transformers passes it
            layer.self_attn.hybridflow_sp_group = group
            layer.self_attn.hybridflow_sp_size = sp_size
        self.sp_group, self.sp_size, self.sp_rank = group, sp_size, sp_rank

    def forward(self, input_ids, position_ids, attention_mask, select_rows, select_cols, target_ids=None,
                temperature=1.0, calculate_entropy=False, chunk_size=2048, calculate_sum_pi_squared=False):
        if attention_mask is not None:
            raise ValueError("sequence parallelism needs the stripped layout (use_remove_padding=True)")
        sp, rank = self.sp_size, self.sp_rank
        length = input_ids.shape[1]
        piece = -(-length // sp)
        pad = piece * sp - length  # right padding: invisible to real tokens under the causal mask
        input_ids = F.pad(input_ids, (0, pad))
        position_ids = F.pad(position_ids, (0, pad))
        lo = rank * piece
        backbone, _ = self._parts()
        hidden = backbone(
            input_ids=input_ids[:, lo : lo + piece], position_ids=position_ids[:, lo : lo + piece],
            attention_mask=None, use_cache=False,
        ).last_hidden_state  # [b, L/sp, H]
        owner = torch.div(select_cols, piece, rounding_mode="floor")
        mine = owner == rank
        selected = hidden[select_rows[mine], select_cols[mine] - lo]
        targets = target_ids[mine] if target_ids is not None else None
        empty = hidden[:0, 0, 0].float()
        local = self.head_outputs(selected, targets, temperature, calculate_entropy, chunk_size, empty,
                                  calculate_sum_pi_squared)
        return {k: _GatherPositions.apply(v, owner, rank, sp, self.sp_group) for k, v in local.items()}
