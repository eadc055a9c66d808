"""The native rollout's decode-attention kernel alone over a generate call's decode steps; prints one JSON document.

    .venv/bin/python benchmarks/decode_attention.py                          # 16 and 64 rows, fp32 and bf16
    .venv/bin/python benchmarks/decode_attention.py --other /tmp/before      # and another checkout's kernel, alternated
    .venv/bin/python benchmarks/decode_attention.py --rows 64 --dtypes fp32 --kv-heads 2 --group 7 --head-dim 64

The shape is the mid model's (8 layers, 4 KV heads of 64, 2 query heads each) with rollout_throughput.py's prompts (a
cache of 33 prompt columns, left padding of 0-16 columns) and 64 new tokens: step t attends over 33 + t columns of each
layer's cache, as cpu_attention.py's kernel does in a generate call with one sample per prompt. At 64 rows the caches
(102 MB in fp32) do not fit in the last-level cache, so each step reads them from memory, as in a real decode step,
where the projections' weights stream through the caches between two layers' attention. Reported per rows and dtype:
milliseconds for the 64 steps (best and median of --rounds); with ``--other``, the same for that checkout's
``cpu_decode_attention.c`` (built the same way, runs alternated A B B A ...) and whether both give the same output
bits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, document, emit, log

from hybridflow.engines.rollout.c_kernels import load_library
from hybridflow.engines.rollout.cpu_attention import DecodeAttentionKernel

SOURCE = os.path.join("hybridflow", "engines", "rollout", "cpu_decode_attention.c")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def kernel_of(tree: str, label: str) -> DecodeAttentionKernel:
    lib = load_library(Path(tree) / SOURCE, f"decode_attention_bench_{label}", "decode attention", "nothing is timed")
    if lib is None:
        raise SystemExit(f"the decode-attention kernel of {tree} did not build (see the warning above)")
    return DecodeAttentionKernel(lib)


def time_steps(kernel, caches, q, out, start, prompt_len: int, new_tokens: int, scratch, threads: int) -> float:
    """Seconds for new_tokens decode steps of every layer's attention (step t: prompt_len + t columns)."""
    begin = time.perf_counter()
    for t in range(1, new_tokens + 1):
        for keys, values in caches:
            kernel._call(q, out, q.shape[-1] ** -0.5, None, keys, values, prompt_len + t, None, keys, values, 0, start,
                         None, None, scratch, threads)
    return time.perf_counter() - begin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="16,64")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--group", type=int, default=2, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=33)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--other", default=None, help="another checkout of hybridflow: its kernel runs alternated with ours")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"this_tree": kernel_of(ROOT, "this_tree")}
    if args.other:
        kernels["other"] = kernel_of(os.path.abspath(args.other), "other")
    KV, G, D, P, new = args.kv_heads, args.group, args.head_dim, args.prompt_len, args.new_tokens
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            g = torch.Generator().manual_seed(rows)
            caches = [(torch.randn(rows, KV, D, P + new, generator=g).to(dtype),
                       torch.randn(rows, KV, P + new, D, generator=g).to(dtype)) for _ in range(args.layers)]
            start = torch.randint(0, P // 2 + 1, (rows,), generator=g, dtype=torch.int32)
            q = torch.randn(rows, KV, G, D, generator=g).to(dtype)
            scratch = DecodeAttentionKernel.scratch(args.threads, G, D, P + new)
            outs, seconds = {k: torch.empty_like(q) for k in kernels}, {k: [] for k in kernels}
            for r in range(args.rounds):
                for label in (list(kernels) if r % 2 == 0 else list(reversed(kernels))):
                    seconds[label].append(time_steps(kernels[label], caches, q, outs[label], start, P, new, scratch,
                                                     args.threads))
            cache_mb = round(sum(k.nbytes + v.nbytes for k, v in caches) / 2**20, 1)
            row = {"rows": rows, "dtype": name, "cache_mb": cache_mb}
            for label, s in seconds.items():
                row[label] = {"best_ms": round(min(s) * 1e3, 1), "median_ms": round(sorted(s)[len(s) // 2] * 1e3, 1)}
            if args.other:
                row["same_output_bits"] = torch.equal(outs["this_tree"], outs["other"])
            log(row)
            results.append(row)
    emit(document("decode_attention", vars(args), {"by_rows": results}))


if __name__ == "__main__":
    main()
