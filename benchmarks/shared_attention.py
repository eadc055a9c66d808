"""Attention of a packed micro-batch with shared prompts (engines/shared_prompts.py), timed alone; prints one JSON
document.

    python benchmarks/shared_attention.py [--shapes 4x4x23x64,8x8x100x200,2x8x300x40] [--threads 2]

A shape ``GxNxPxR`` is G prompts of P tokens with N responses each; responses are R tokens (``--vary``: lengths
drawn in [1, R]). Per shape: milliseconds of one ``shared_prompt_attention`` call (forward, then forward and
backward, with a random weighting of the output), on q/k/v laid out as the training engine's model gives them
([1, heads, T, D] views of [1, T, heads, D]); next to them one batched causal SDPA over the same rows unshared
([G * N, heads, P + R, D], the attention of a packed row without shared prompts when all rows have one length), and
whether the plan took the masked form. The heads are the mid model's (8 query, 4 KV heads of 64). Medians of
--repeats timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import document, emit, log, median
from hybridflow.engines import shared_prompts

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def _groups(n_groups: int, n: int, prompt: int, response: int, vary: bool) -> tuple[list, int]:
    g = torch.Generator().manual_seed(0)
    groups, pos = [], 0
    for _ in range(n_groups):
        start, responses = pos, []
        pos += prompt
        for _ in range(n):
            length = int(torch.randint(1, response + 1, (1,), generator=g)) if vary else response
            responses.append((pos, length))
            pos += length
        groups.append((start, prompt, responses))
    return groups, pos


def _ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(median(times), 3)


def measure(shape: str, vary: bool, repeats: int) -> dict:
    n_groups, n, prompt, response = (int(x) for x in shape.split("x"))
    groups, tokens = _groups(n_groups, n, prompt, response, vary)
    shared = shared_prompts.SharedPrompts(groups=groups, tokens=tokens)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, tokens, h, HEAD_DIM, generator=g).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    weights = torch.randn(1, tokens, HEADS, HEAD_DIM, generator=g)

    def forward():
        return shared_prompts.shared_prompt_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      shared, 0.0, None, HEADS // KV_HEADS)

    def both():
        (forward() * weights).sum().backward()

    rows = n_groups * n
    uq, uk, uv = (torch.randn(rows, prompt + response, h, HEAD_DIM, generator=g).requires_grad_()
                  for h in (HEADS, KV_HEADS, KV_HEADS))

    def unshared():
        return F.scaled_dot_product_attention(uq.transpose(1, 2), uk.transpose(1, 2), uv.transpose(1, 2),
                                              is_causal=True, enable_gqa=True)

    def unshared_both():
        unshared().sum().backward()

    plan = shared.plan(torch.device("cpu"))
    masked = any(call[-1] is not None for call in plan["calls"]) if "calls" in plan else None
    return {"tokens_shared": tokens, "tokens_unshared": rows * (prompt + response), "masked_form": masked,
            "shared_forward_ms": _ms(forward, repeats), "shared_forward_backward_ms": _ms(both, repeats),
            "unshared_forward_ms": _ms(unshared, repeats), "unshared_forward_backward_ms": _ms(unshared_both, repeats)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4x4x23x64,8x8x100x200,2x8x300x40")
    p.add_argument("--vary", action="store_true", help="response lengths drawn in [1, R]")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for shape in args.shapes.split(","):
        log("shape", shape)
        results[shape] = measure(shape, args.vary, args.repeats)
    emit(document("shared_attention", vars(args), results))


if __name__ == "__main__":
    main()
