"""Prefill under a token budget: the unique prompts ``[B, P]`` run in groups of whole prompts, each group's padded
tokens ``rows * P`` at most ``max_num_batched_tokens`` (veRL/vLLM's key), instead of all B at once.

What it bounds: the prefill's activations (``[rows, P, hidden]`` and the MLP's ``[rows, P, intermediate]``), its
attention masks and scores (``[rows, heads, P, P]``) and the prompt logits, which otherwise grow with the whole
batch. What it does not do: split one prompt along its length (vLLM's chunked prefill does); a prompt longer than the
budget is prefilled alone, so a group holds at least one prompt. Each group writes its K/V into the call's cache as
if the batch had been prefilled at once, so decoding, and the generated tokens, are unchanged
(tests/engines/test_chunked_prefill.py: greedy and seeded sampling, token for token).
"""

from __future__ import annotations

import torch

from hybridflow.engines.rollout.packed_prefill import packed_prefill

__all__ = ["chunked_prefill", "prefill_groups"]


def prefill_groups(prompts: int, prompt_len: int, max_tokens: int | None) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` covering `prompts` rows, each at most ``max(1, max_tokens // prompt_len)`` rows."""
    if max_tokens is None or prompts * prompt_len <= max_tokens:
        return [(0, prompts)]
    if max_tokens <= 0:
        raise ValueError(f"max_num_batched_tokens must be positive, got {max_tokens}")
    rows = max(1, max_tokens // prompt_len)
    return [(lo, min(lo + rows, prompts)) for lo in range(0, prompts, rows)]


class _GroupWriter:
    """The prefill's cache interface for one group: keeps each layer's K/V until every group has run."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def write_prompts(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[layer], self.values[layer] = keys, values


def chunked_prefill(model, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                    cache, max_tokens: int | None) -> torch.Tensor:
    """``model.prefill`` (native_model.NativeDecoder; without the padding: packed_prefill.py) over `prefill_groups`; returns the last-position logits
    ``[B, V]`` and writes all B prompts' K/V ``[B, kv_heads, P, head_dim]`` per layer through ``cache.write_prompts``
    (a KVCache or the fixed-shape prompt writer), in row order."""
    B, P = input_ids.shape
    groups = prefill_groups(B, P, max_tokens)
    if len(groups) == 1:
        return packed_prefill(model, input_ids, position_ids, attention_mask, cache)
    logits, writers = [], []
    for lo, hi in groups:
        writer = _GroupWriter()
        logits.append(packed_prefill(model, input_ids[lo:hi], position_ids[lo:hi], attention_mask[lo:hi], writer))
        writers.append(writer)
    for layer in sorted(writers[0].keys):
        keys = torch.cat([w.keys.pop(layer) for w in writers])
        values = torch.cat([w.values.pop(layer) for w in writers])
        cache.write_prompts(layer, keys, values)
    return torch.cat(logits)
