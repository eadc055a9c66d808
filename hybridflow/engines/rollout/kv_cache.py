"""The native rollout's KV cache, with each prompt's keys and values stored once for all of its n samples.

Layout, per layer, allocated once per ``generate`` call and written in place:
  * n > 1 (``shared``): a prompt part ``[prompts, kv_heads, P, head_dim]`` filled by the prefill, one copy per unique
    prompt, and a generated part ``[rows, kv_heads, max_new, head_dim]``, one slot per running sample;
  * n == 1: one part ``[rows, kv_heads, P + max_new, head_dim]``: there is nothing to share, and one segment costs two
    fewer matmuls per layer.
Keys are stored transposed, ``[..., head_dim, length]`` (values as above): the score matmul ``q @ K^T`` then reads
each head's keys as a plain row-major ``[head_dim, length]`` operand, which the batched small matmuls of a decode step
ran ~20% faster on than on a transposed view (attention time in one 64-row generate call, mid model, CPU, 1 thread).
Rows are compacted (moved to the front) as samples finish.

Decode attention (``decode_attention``) scores a row's query against its prompt's keys and its own generated keys and
takes one softmax over both. For the shared prompt part the running rows are regrouped by prompt, so each prompt's
keys are read once per step for all of its samples instead of once per sample: with GRPO's n = 8 and long prompts
this is most of the attention's memory traffic (and n times less cache memory).

The G query heads that share a KV head act as G query positions of that head, so K/V are never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KVCache", "RunningRows", "attention_bias", "decode_attention", "softcap_scores"]


class KVCache:
    """Keys and values of one generate() call; see the module docstring for the two layouts."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *, prompts: int, prompt_len: int, n: int,
                 max_new: int, dtype: torch.dtype, device: torch.device):
        def alloc(*shape: int) -> list[torch.Tensor]:
            return [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

        self.shared = n > 1
        self.prompt_len = prompt_len
        self.kv_heads = kv_heads
        # keys: [batch, kv_heads, head_dim, length] (transposed, see the module docstring); values: [.., length, head_dim]
        if self.shared:
            self.prompt_keys = alloc(prompts, kv_heads, head_dim, prompt_len)
            self.prompt_values = alloc(prompts, kv_heads, prompt_len, head_dim)
            self.keys = alloc(prompts * n, kv_heads, head_dim, max_new)
            self.values = alloc(prompts * n, kv_heads, max_new, head_dim)
        else:
            length = prompt_len + max_new
            self.keys, self.values = alloc(prompts, kv_heads, head_dim, length), alloc(prompts, kv_heads, length, head_dim)
        # where generated token t of a row is stored along the length axis of self.keys / self.values
        self.offset = 0 if self.shared else prompt_len

    def write_prompts(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The prefill's K/V [prompts, kv_heads, P, head_dim] of one layer."""
        if self.shared:
            self.prompt_keys[layer][: keys.shape[0]] = keys.transpose(-1, -2)
            self.prompt_values[layer][: keys.shape[0]] = values
        else:
            self.keys[layer][: keys.shape[0], :, :, : self.prompt_len] = keys.transpose(-1, -2)
            self.values[layer][: keys.shape[0], :, : self.prompt_len] = values

    def write_token(self, layer: int, column: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """K/V [rows, kv_heads, head_dim] of generated token `column` of the running rows."""
        rows = keys.shape[0]
        self.keys[layer][:rows, :, :, self.offset + column] = keys
        self.values[layer][:rows, :, self.offset + column] = values

    def compact(self, keep: torch.Tensor, generated: int) -> None:
        """Move rows `keep` [m] to the front (their prompt, if not shared, and first `generated` tokens)."""
        m, length = keep.numel(), self.offset + generated
        for cache in self.keys:
            cache[:m, :, :, :length] = cache[keep, :, :, :length]
        for cache in self.values:
            cache[:m, :, :length] = cache[keep, :, :length]


@dataclass
class RunningRows:
    """Which prompt slot and sample each running row is.

    ``grouped``: the rows are exactly prompt-major ``[rows // n, n]`` (true until the first compaction), so regrouping
    them by prompt is a reshape instead of a scatter.
    """

    prompt_index: torch.Tensor  # [rows] prompt slot of each row
    sample_index: torch.Tensor  # [rows] sample number of each row within its prompt
    n: int
    grouped: bool = True


def _by_prompt(x: torch.Tensor, rows: RunningRows, prompts: int) -> torch.Tensor:
    """[rows, kv, G, F] -> [prompts, kv, n*G, F]: each prompt's samples side by side (zeros for absent samples)."""
    r, kv, G, F = x.shape
    if rows.grouped:
        grouped = x.reshape(r // rows.n, rows.n, kv, G, F)
    else:
        grouped = x.new_zeros(prompts, rows.n, kv, G, F)
        grouped[rows.prompt_index, rows.sample_index] = x
    return grouped.transpose(1, 2).reshape(grouped.shape[0], kv, rows.n * G, F)


def _by_row(x: torch.Tensor, rows: RunningRows, G: int) -> torch.Tensor:
    """Inverse of _by_prompt: [prompts, kv, n*G, F] -> [rows, kv, G, F]."""
    p, kv, _, F = x.shape
    grouped = x.view(p, kv, rows.n, G, F)
    if rows.grouped:
        return grouped.transpose(1, 2).reshape(p * rows.n, kv, G, F)
    return grouped[rows.prompt_index, :, rows.sample_index]  # advanced indices around a slice: [rows, kv, G, F]


def softcap_scores(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's attention soft-capping, cap * tanh(scores / cap); identity when cap is None."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def decode_attention(q: torch.Tensor, cache: KVCache, layer: int, rows: RunningRows, bias,
                     length: int, scale: float, softcap: float | None = None) -> torch.Tensor:
    """One decode step of attention over the row's prompt and its first `length` generated tokens.

    q [rows, kv, G, D]; bias: the additive mask from ``attention_bias``; softcap: soft-cap the scaled scores before
    the mask (Gemma 2). Returns [rows, kv, G, D].
    """
    r, kv, G, D = q.shape
    if not cache.shared:
        end = cache.offset + length
        keys = cache.keys[layer][:r, :, :, :end].reshape(r * kv, D, end)  # a view, no copy
        if softcap is None:
            scores = torch.baddbmm(bias, q.reshape(r * kv, G, D), keys, alpha=scale)
        else:
            scores = softcap_scores(torch.bmm(q.reshape(r * kv, G, D), keys) * scale, softcap) + bias
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, cache.values[layer][:r, :, :end].reshape(r * kv, end, D)).view(r, kv, G, D)
    P = cache.prompt_len
    bias, own_bias = bias
    prompts = r // rows.n if rows.grouped else cache.prompt_keys[layer].shape[0]
    prompt_keys = cache.prompt_keys[layer][:prompts]
    prompt_values = cache.prompt_values[layer][:prompts]
    q = q * scale
    prompt_scores = _by_row(torch.matmul(_by_prompt(q, rows, prompts), prompt_keys), rows, G)
    prompt_scores = softcap_scores(prompt_scores, softcap)
    own_scores = torch.matmul(q, cache.keys[layer][:r, :, :, :length])  # every generated key is real
    own_scores = softcap_scores(own_scores, softcap)
    if own_bias is not None:  # a sliding window that has moved past some generated keys
        own_scores = own_scores + own_bias
    scores = torch.cat((prompt_scores + bias, own_scores), dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    prompt_probs, own_probs = probs.split((P, length), dim=-1)
    out = torch.matmul(own_probs, cache.values[layer][:r, :, :length])
    return out + _by_row(torch.matmul(_by_prompt(prompt_probs, rows, prompts), prompt_values), rows, G)


def attention_bias(cache: KVCache, prompt_bias: torch.Tensor, length: int, window: int | None = None):
    """decode_attention's additive mask from the rows' prompt masks [rows, P] (0, or -inf at left padding).

    Shared layout: ([rows, 1, 1, P] over the prompt keys, [1, 1, 1, length] over the generated keys or None).
    Otherwise [rows * kv_heads, 1, P + length] over prompt and generated keys (generated keys are always real).
    ``window``: a sliding-window layer's size; the query (generated token length - 1, column P + length - 1) sees
    only keys less than `window` columns back, as transformers' sliding-window mask does. Built once per decode step
    and window, shared by the layers.
    """
    P = cache.prompt_len
    outside = None  # [P + length] bool: columns the window has left behind
    if window is not None and P + length > window:
        outside = torch.arange(P + length, device=prompt_bias.device) <= P + length - 1 - window
    if cache.shared:
        if outside is None:
            return prompt_bias[:, None, None, :], None
        mask = torch.zeros(P + length, dtype=prompt_bias.dtype, device=prompt_bias.device)
        mask.masked_fill_(outside, float("-inf"))
        return (prompt_bias + mask[:P])[:, None, None, :], mask[P:][None, None, None, :]
    rows = prompt_bias.shape[0]
    bias = torch.nn.functional.pad(prompt_bias, (0, length))
    if outside is not None:
        bias = bias.masked_fill(outside[None], float("-inf"))
    return bias[:, None, :].expand(rows, cache.kv_heads, bias.shape[1]).reshape(rows * cache.kv_heads, 1, -1)
