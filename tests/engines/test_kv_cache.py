"""The native rollout's KV cache (engines/rollout/kv_cache.py; keys stored transposed): what write_prompts /
write_token / compact store is what decode_attention attends over, in both layouts (shared prompt part for n > 1, one
segment for n == 1), checked against softmax(q K^T * scale + mask) V written out from the raw keys and values."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout.kv_cache import KVCache, RunningRows, attention_bias, decode_attention

LAYERS, KV, G, D, P, MAX_NEW = 2, 2, 3, 8, 5, 6


def _reference(q, keys, values, valid, scale):
    """q [r, kv, G, D]; keys/values [r, kv, L, D]; valid [r, L] bool -> [r, kv, G, D]."""
    scores = torch.einsum("rhgd,rhld->rhgl", q, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.einsum("rhgl,rhld->rhgd", torch.softmax(scores, -1), values)


@pytest.mark.parametrize("n,window", [(1, None), (3, None), (1, 7), (3, 7)])
def test_decode_attention_sees_each_rows_prompt_and_own_tokens(n, window):
    g = torch.Generator().manual_seed(0)
    prompts = 2
    rows = prompts * n
    cache = KVCache(LAYERS, KV, D, prompts=prompts, prompt_len=P, n=n, max_new=MAX_NEW, dtype=torch.float32,
                    device=torch.device("cpu"))
    prompt_mask = torch.ones(prompts, P, dtype=torch.bool)
    prompt_mask[1, :2] = False  # left padding of the second prompt
    prompt_k = torch.randn(LAYERS, prompts, KV, P, D, generator=g, dtype=torch.float32)
    prompt_v = torch.randn(LAYERS, prompts, KV, P, D, generator=g, dtype=torch.float32)
    for li in range(LAYERS):
        cache.write_prompts(li, prompt_k[li], prompt_v[li])
    own_k = torch.randn(LAYERS, rows, KV, MAX_NEW, D, generator=g, dtype=torch.float32)
    own_v = torch.randn(LAYERS, rows, KV, MAX_NEW, D, generator=g, dtype=torch.float32)
    prompt_of = torch.arange(rows) // n
    live = torch.arange(rows)  # original row of each running slot
    running = RunningRows(prompt_of, torch.arange(rows) % n, n)
    bias_rows = torch.zeros(rows, P, dtype=torch.float32).masked_fill(~prompt_mask[prompt_of], float("-inf"))
    for step in range(MAX_NEW):
        if step == 3:  # the first row stops: compact the others to the front
            keep = torch.arange(1, live.numel())
            cache.compact(keep, step)
            live, bias_rows = live[keep], bias_rows[keep]
            running = RunningRows(running.prompt_index[keep], running.sample_index[keep], n, grouped=False)
        r = live.numel()
        for li in range(LAYERS):
            cache.write_token(li, step, own_k[li, live, :, step], own_v[li, live, :, step])
        bias = attention_bias(cache, bias_rows, step + 1, window=window)
        q = torch.randn(r, KV, G, D, generator=g, dtype=torch.float32)
        for li in range(LAYERS):
            got = decode_attention(q, cache, li, running, bias, step + 1, scale=0.5)
            keys = torch.cat((prompt_k[li, prompt_of[live]], own_k[li, live, :, : step + 1]), dim=2)
            values = torch.cat((prompt_v[li, prompt_of[live]], own_v[li, live, :, : step + 1]), dim=2)
            valid = torch.cat((prompt_mask[prompt_of[live]], torch.ones(r, step + 1, dtype=torch.bool)), dim=1)
            if window is not None:  # the query at column P + step sees keys less than `window` columns back
                valid &= torch.arange(P + step + 1) > P + step - window
            torch.testing.assert_close(got, _reference(q, keys, values, valid, 0.5), rtol=1e-5, atol=1e-6)
