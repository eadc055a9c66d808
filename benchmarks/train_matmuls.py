"""The training step's matrix products alone, in the layouts autograd gives them, at 1 and 2 threads; prints one JSON.

    .venv/bin/python benchmarks/train_matmuls.py                            # mid, 1,116 packed tokens, bf16 and fp32
    .venv/bin/python benchmarks/train_matmuls.py --dtypes bf16 --tokens 1116,2048 --threads 2

A linear layer y = x W^T of a packed micro-batch (x [T, in], W [out, in]) costs three products: the forward
``x @ W.t()``, the input gradient ``g @ W`` and the weight gradient ``g.t() @ x`` (g = dL/dy [T, out]; both operands of
the last are transposed views). For each of the model's projections (q, k/v, o, gate/up, down; the head is left out)
this times ``torch.mm`` on exactly those operands, and two rewrites of the same product: the output's columns in two
calls (``split_n``) and its rows in two calls (``split_m``), each with whether its result equals the plain product bit
for bit. Reported per product: TFLOP/s (best of --repeats), the thread scaling (2 threads over 1), and the measured
square-matmul peak of the dtype (metrics.measure_peak_flops) to compare with. On a CPU with AMX, torch's bf16 products
are oneDNN's AMX kernels; a product whose 2-thread rate is near its 1-thread rate is one where oneDNN kept one thread
busy (docs/benchmarks-history.md, thirty-sixth session).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import document, emit, log

from hybridflow.common.metrics import measure_peak_flops
from hybridflow.engines.tiny import SIZES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def projections(size: str) -> dict[str, tuple[int, int]]:
    """{name: (in_features, out_features)} of one decoder layer of the named benchmark size."""
    spec = SIZES[size]
    head_dim = spec.hidden_size // spec.num_heads
    inter = spec.intermediate_size or 4 * spec.hidden_size
    return {
        "q": (spec.hidden_size, spec.hidden_size),
        "kv": (spec.hidden_size, spec.num_kv_heads * head_dim),
        "o": (spec.hidden_size, spec.hidden_size),
        "gate_up": (spec.hidden_size, inter),
        "down": (inter, spec.hidden_size),
    }


def best_seconds(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def split_n(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    half = b.shape[1] // 2
    torch.mm(a, b[:, :half], out=out[:, :half])
    torch.mm(a, b[:, half:], out=out[:, half:])
    return out


def split_m(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    half = a.shape[0] // 2
    torch.mm(a[:half], b, out=out[:half])
    torch.mm(a[half:], b, out=out[half:])
    return out


def products(tokens: int, fan_in: int, fan_out: int, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, ...]]:
    """The three products of one linear layer as (a, b): forward, input gradient, weight gradient."""
    x = torch.randn(tokens, fan_in, dtype=dtype)
    weight = torch.randn(fan_out, fan_in, dtype=dtype)
    grad = torch.randn(tokens, fan_out, dtype=dtype)
    return {"forward": (x, weight.t()), "grad_input": (grad, weight), "grad_weight": (grad.t(), x)}


def measure(a: torch.Tensor, b: torch.Tensor, threads: tuple[int, ...], repeats: int) -> dict:
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    plain = a @ b
    out = torch.empty_like(plain)
    row = {"m_k_n": [a.shape[0], a.shape[1], b.shape[1]],
           "a_layout": "rows" if a.stride(-1) == 1 else "columns", "b_layout": "rows" if b.stride(-1) == 1 else "columns"}
    for rewrite, fn in (("plain", lambda: torch.mm(a, b, out=out)), ("split_n", lambda: split_n(a, b, out)),
                        ("split_m", lambda: split_m(a, b, out))):
        cell = {}
        for n in threads:
            torch.set_num_threads(n)
            cell[f"tflops_{n}t"] = round(flops / best_seconds(fn, repeats) / 1e12, 3)
        if rewrite != "plain":
            cell["same_bits"] = bool(torch.equal(fn(), plain))
        if len(threads) > 1:
            cell["thread_scaling"] = round(cell[f"tflops_{threads[-1]}t"] / cell[f"tflops_{threads[0]}t"], 2)
        row[rewrite] = cell
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="mid", choices=sorted(SIZES))
    parser.add_argument("--tokens", default="1116", help="comma-separated packed token counts (rows of x)")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts, ascending")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    threads = tuple(int(t) for t in args.threads.split(","))
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"--dtypes {unknown} unknown; choose from {sorted(DTYPES)}")
    torch.manual_seed(0)
    results = {}
    for name in dtypes:
        dtype = DTYPES[name]
        peak = measure_peak_flops("cpu", dtype=dtype, num_threads=threads[-1])
        results[name] = {"peak_tflops": round(peak / 1e12, 3)}
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows = {}
            for proj, (fan_in, fan_out) in projections(args.size).items():
                for product, (a, b) in products(tokens, fan_in, fan_out, dtype).items():
                    rows[f"{proj}.{product}"] = measure(a, b, threads, args.repeats)
                    log(name, tokens, proj, product, rows[f"{proj}.{product}"]["plain"])
            results[name][f"tokens_{tokens}"] = rows
    emit(document("train_matmuls", {"size": args.size, "tokens": args.tokens, "dtypes": dtypes,
                                    "threads": list(threads), "repeats": args.repeats}, results))


if __name__ == "__main__":
    main()
