"""Prefill without the left padding: the layers' matmuls run on the prompts' real tokens only.

A batch of B distinct prompts ``[B, P]`` is left-padded to its longest prompt; with prompts of 16..32 tokens about a
quarter of the ``B * P`` positions are padding, and ``NativeDecoder.prefill`` pushes them through every projection
and MLP like real tokens. Here the real tokens travel as one flat ``[T, hidden]`` batch through the decoder's layer
loop (``NativeDecoder.prompt_layers``); only attention, which needs each prompt's keys side by side, scatters q/k/v back
into the padded ``[B, heads, P, head_dim]`` layout (zeros at padding) and runs the same masked attention as
``prefill``. Row for row the projections compute the same dot products, so the logits and the stored K/V of real
positions equal the padded prefill's (tests/engines/test_rollout_packed_prefill.py); the cache's padding slots hold
zeros, which decode_attention's -inf mask never lets through.
"""

from __future__ import annotations

import torch

from hybridflow.engines.rollout.native_model import prefill_masks

__all__ = ["packed_prefill"]


def packed_prefill(model, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                   cache) -> torch.Tensor:
    """``model.prefill`` (native_model.NativeDecoder) computed on the real tokens only; same contract: writes the
    prompts' K/V ``[B, kv_heads, P, head_dim]`` per layer through ``cache.write_prompts`` and returns fp32 logits of
    the last prompt position ``[B, V]``.

    Falls back to ``model.prefill`` when nothing is padded, and while MoE routes are being recorded (moe.py's
    RouteRecorder reads one route per padded position).
    """
    B, P = input_ids.shape
    valid = attention_mask.bool().reshape(-1)
    if bool(valid.all()) or model.route_log is not None:
        return model.prefill(input_ids, position_ids, attention_mask, cache)
    s = model.shape
    real = valid.nonzero().squeeze(-1)  # [T] flat indices of the real tokens in [B * P]
    masks = prefill_masks(s, attention_mask)

    def padded(x: torch.Tensor) -> torch.Tensor:
        """[T, heads, D] -> [B, heads, P, D], zeros at padding."""
        out = x.new_zeros(B * P, *x.shape[1:])
        out.index_copy_(0, real, x)
        return out.view(B, P, *x.shape[1:]).transpose(1, 2)

    def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = model.prompt_attention(li, padded(q), padded(k), padded(v), masks, cache)  # [B, heads, P, D]
        return out.transpose(1, 2).reshape(B * P, model.q_size).index_select(0, real)

    hidden, normed = model.prompt_layers(input_ids.reshape(-1)[real], position_ids.reshape(-1)[real], attend)
    # left padding: every prompt's last column is real, and the last of its row's tokens in the flat order
    last = attention_mask.bool().sum(-1).cumsum(0) - 1
    return model.prompt_logits(hidden.index_select(0, last), normed)
