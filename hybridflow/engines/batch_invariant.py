"""Batch-invariant numerics: the rollout's fp32 log-probs equal the training engine's bit for bit.

A token's log-prob differs between the native rollout and the training engine although both compute the same
function: the training forward sees a whole row ``[T]`` per matmul, the decode step one token per row, and a CPU
BLAS rounds a row's dot products differently with the shapes around it (which shapes do and do not change a row's
bits was measured first: docs/benchmarks.md, "A real model"). So both engines, when
``actor_rollout_ref.model.batch_invariant=true``:

- run attention through `invariant_attention` (registered with transformers' ``AttentionInterface`` for the
  training engine; called by the native rollout's batch-invariant steps, rollout/exact_decode.py), whose matmuls
  get canonical shapes and whose ``p @ v`` sums over fixed blocks of KEY_BLOCK keys;
- run their projections through the same library (`onednn_matmuls`: oneDNN on a CPU that has it, where the rollout
  keeps its packed weights and the training engine's ``nn.Linear`` layers are `OneDNNLinear`, onednn_train.py;
  ``F.linear`` elsewhere);
- feed every matmul a multiple of `ROW_MULTIPLE` rows;
- lay a row's keys out from column 0 (the training engine's stripped rows).

The result is exact, not close: tests/engines/test_batch_invariant.py compares with ``torch.equal``.
"""

from __future__ import annotations

import torch

from hybridflow.engines.rollout.onednn_linear import onednn_available

__all__ = ["ATTENTION_NAME", "KEY_BLOCK", "ROW_MULTIPLE", "enable_batch_invariant_attention", "invariant_attention",
           "onednn_matmuls", "pad_rows", "round_up"]

ATTENTION_NAME = "hybridflow_batch_invariant"
ROW_MULTIPLE = 4  # every matmul sees a multiple of this many rows
KEY_BLOCK = 128  # p @ v sums over keys in fixed blocks of this many
KEY_MULTIPLE = 16  # keys padded (masked) to a multiple of this, at least 16


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_rows(x: torch.Tensor, multiple: int = ROW_MULTIPLE, dim: int = 0) -> torch.Tensor:
    """x with zeros appended along `dim` up to a multiple of `multiple` (x itself when it already is one)."""
    extra = round_up(x.shape[dim], multiple) - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat((x, x.new_zeros(shape)), dim=dim)


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                        softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [soft-capped], masked) v, with rounding that depends on each query's keys only.

    q [N, H, M, D]; k, v [N, KV, L, D] (H a multiple of KV: grouped-query heads share their KV head); allowed
    [N, 1, M, L] bool (key j visible to query i). Returns [N, H, M, D] in q's dtype. Query i's output is the same
    bits for any M, any L past its last visible key and any other rows: the padding below and the fixed key blocks
    make the matmuls' shapes canonical. The G query heads of a KV head are stacked as G * M query rows of that head
    (heads h = kv * G + g, transformers' repeat_kv order), so K and V are read as they are, never repeated.
    """
    N, H, M, D = q.shape
    KV, L = k.shape[1], k.shape[2]
    G = H // KV
    q = q.reshape(N, KV, G * M, D)
    allowed = allowed.expand(N, 1, M, L)
    if G > 1:
        allowed = allowed.repeat(1, 1, G, 1)
    rows, keys = round_up(G * M, ROW_MULTIPLE), max(KEY_MULTIPLE, round_up(L, KEY_MULTIPLE))
    if rows != G * M:
        q = pad_rows(q, ROW_MULTIPLE, dim=2)
        # a padded query sees key 0 only: finite, cut off at the end, and no NaN for backward to spread
        extra = allowed.new_zeros(N, 1, rows - G * M, L)
        extra[..., 0] = True
        allowed = torch.cat((allowed, extra), dim=2)
    if keys != L:
        k, v = pad_rows(k, keys, dim=2), pad_rows(v, keys, dim=2)
        allowed = torch.cat((allowed, allowed.new_zeros(N, 1, rows, keys - L)), dim=3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = None
    for lo in range(0, keys, KEY_BLOCK):
        part = torch.matmul(probs[..., lo : lo + KEY_BLOCK], v[:, :, lo : lo + KEY_BLOCK])
        out = part if out is None else out + part
    return out[:, :, : G * M].reshape(N, H, M, D)


def causal_allowed(q_len: int, k_len: int, device, window: int | None = None) -> torch.Tensor:
    """[q_len, k_len] bool: query i (the last q_len of k_len positions) sees key j <= its position, and fewer than
    `window` positions back when given (transformers' sliding window)."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (q_pos - k_pos < window)
    return allowed


def batch_invariant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, H, T, D]``, ``key/value [B, KV, S, D]`` -> ``[B, T, H, D]``.

    transformers builds no mask for an implementation it does not know, so rows are causal from their first column
    (the training engine's stripped rows, micro_batch.build_bucket); the sliding window and soft cap come from the
    attention module as keyword arguments.
    """
    if attention_mask is not None:
        raise ValueError(f"{ATTENTION_NAME}: got an attention mask; batch-invariant attention takes rows stripped to "
                         "their real tokens (actor_rollout_ref.model.use_remove_padding=true)")
    if kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError(f"{ATTENTION_NAME}: packed rows are not supported; set use_sequence_packing=false")
    if dropout and module.training:
        raise ValueError(f"{ATTENTION_NAME}: attention dropout {dropout} would make the forward random; set the "
                         "model config's attention_dropout to 0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    allowed = causal_allowed(query.shape[2], key.shape[2], query.device, sliding_window)[None, None]
    allowed = allowed.expand(query.shape[0], 1, *allowed.shape[2:])
    out = invariant_attention(query, key, value, allowed, scale, softcap)
    return out.transpose(1, 2).contiguous(), None


def enable_batch_invariant_attention(hf_model: torch.nn.Module) -> str:
    """Switch a transformers model to `batch_invariant_attention` (registered once); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, batch_invariant_attention)
    hf_model.set_attn_implementation(ATTENTION_NAME)
    if getattr(hf_model.config, "_attn_implementation", None) != ATTENTION_NAME:
        raise ValueError(f"{type(hf_model).__name__} did not take the {ATTENTION_NAME} attention implementation (its "
                         "modeling code does not use transformers' AttentionInterface); set "
                         "actor_rollout_ref.model.batch_invariant=false for this model")
    return ATTENTION_NAME


# ------------------------------------------------------------------------------------------------ projections
def onednn_matmuls(device: torch.device) -> bool:
    """Whether both engines compute fp32 projections with oneDNN on `device` (a CPU whose torch has it): the
    rollout's packed weights are ~2.4x faster than MKL's F.linear at 64 rows here (docs/benchmarks.md), and the
    training engine's forward then runs the same kernels."""
    return torch.device(device).type == "cpu" and onednn_available(torch.float32)
