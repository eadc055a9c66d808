"""A decode step's projections alone, by kernel and row count: the native rollout's C kernel (fp32: the panel kernel of
cpu_linear.py; bf16: the tiles of cpu_bf16_linear.py, each kind that runs here: AMX, AVX512-BF16) against oneDNN's
packed matmul (onednn_linear.py) and F.linear, next to the step's two floors; prints one JSON document.

    .venv/bin/python benchmarks/decode_matmuls.py                          # mid, rows 1-64, 2 threads
    .venv/bin/python benchmarks/decode_matmuls.py --size tiny --rows 16,64,512 --threads 1
    .venv/bin/python benchmarks/decode_matmuls.py --dtype bf16 --rows 16,32,64,256   # bf16 tiles against oneDNN
    .venv/bin/python benchmarks/decode_matmuls.py --dtype bf16 --model DIR   # a real model's shapes (random weights)

The step is every layer's q/k/v, o, gate/up and down product plus the output head, on their own (the weights of
all layers in turn, so each is read from memory as in a real step); --model takes the shapes from a model folder's
config.json (e.g. `hybridflow import-gguf --smollm2 DIR`), with random weights of those shapes. Kernels alternate
(A B C A B C ...), --repeats rounds of --steps steps each; reported is each kernel's best round in milliseconds per
step. Floors: the step's FLOPs over the measured matmul peak (metrics.measure_peak_flops), and its weight bytes over
the read bandwidth measured over a buffer of their size (profile_step.read_bandwidth: a sum over the tensor; a
cache that holds the weights counts); a decode step cannot take less than the larger.
Also the time to re-pack all the weights for the C kernel after a weight update (``repack_ms``), into new tensors and
into the old ones. The C kernel's columns are named after it: ``panel_*`` in fp32, ``amx_*`` and
``avx512_bf16_*`` in bf16.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import document, emit, log
from profile_step import read_bandwidth

from hybridflow.common.metrics import measure_peak_flops
from hybridflow.engines.rollout import cpu_bf16_linear, cpu_linear
from hybridflow.engines.rollout.onednn_linear import onednn_available, onednn_linear, pack_onednn
from hybridflow.engines.tiny import SIZES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="mid", choices=sorted(SIZES))
    parser.add_argument("--rows", default="1,4,8,12,16,24,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--model", default=None, help="a model folder whose config.json gives the shapes (not --size)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.set_num_threads(args.threads)
    shapes = model_shapes(args.model) if args.model else size_shapes(args.size)
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=g) * 0.02).to(dtype) for o, i in shapes]
    if dtype == torch.bfloat16:
        kernels = {kind: cpu_bf16_linear.load(kind) for kind in cpu_bf16_linear.available_kinds()}
    else:
        kernels = {"panel": cpu_linear.load()} if cpu_linear.load() is not None else {}
    packed = {
        "F.linear": (weights, lambda x, w: F.linear(x, w)),
        **({"onednn": ([pack_onednn(w) for w in weights], lambda x, w: onednn_linear(x, w, None))}
           if onednn_available(dtype) else {}),
        **{name: ([kernel.pack(w) for w in weights], lambda x, w, kernel=kernel: kernel.linear(x, w, None))
           for name, kernel in kernels.items()},
    }
    peak = measure_peak_flops(dtype=dtype, num_threads=args.threads)
    weight_bytes = weights[0].element_size() * sum(o * i for o, i in shapes)
    bandwidth = read_bandwidth(args.threads, megabytes=max(1, round(weight_bytes / 2**20)))
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(rows, i, generator=g).to(dtype) for _, i in shapes}
        best = {name: float("inf") for name in packed}
        for _ in range(args.repeats):
            for name, (ws, multiply) in packed.items():
                for w, (_, i) in zip(ws, shapes):  # warm: the call's first-use costs, not the weights' cache state
                    multiply(xs[i], w)
                start = time.perf_counter()
                for _ in range(args.steps):
                    for w, (_, i) in zip(ws, shapes):
                        multiply(xs[i], w)
                best[name] = min(best[name], (time.perf_counter() - start) / args.steps)
        flops = 2 * rows * sum(o * i for o, i in shapes)
        row = {f"{name}_ms": round(s * 1e3, 3) for name, s in best.items()}
        row["math_floor_ms"] = round(flops / peak * 1e3, 3)
        row["weight_read_floor_ms"] = round(weight_bytes / bandwidth * 1e3, 3)
        for name_c in kernels:
            row.update({f"{name_c}_vs_{name}": round(best[name_c] / best[name], 3) for name in best if name != name_c})
            row[f"{name_c}_over_floor"] = round(best[name_c] * 1e3 / max(row["math_floor_ms"],
                                                                        row["weight_read_floor_ms"]), 2)
        results[str(rows)] = row
        log(f"rows {rows}: {row}")
    doc_results = {"peak_flops_per_s": peak, "read_bytes_per_s": bandwidth, "weight_bytes": weight_bytes,
                   "by_rows": results}
    for name_c, kernel in kernels.items():  # the kinds share one packed layout: the same re-pack
        doc_results["repack_ms"] = repack_times(kernel, weights, packed[name_c][0], args.repeats)
        log(f"re-pack after a weight update: {doc_results['repack_ms']}")
        break
    first = next(iter(kernels.values()), None)
    emit(document("decode_matmuls", {"size": None if args.model else args.size, "model": args.model,
                                     "dtype": args.dtype, "threads": args.threads,
                                     "steps": args.steps, "repeats": args.repeats, "kernels": list(kernels),
                                     "vector_width": getattr(first, "vector_width", None)},
                  doc_results))


def size_shapes(size: str) -> list[tuple[int, int]]:
    """A decode step's projections [(out, in)] for a tiny-model size: q/k/v, o, gate/up, down per layer; the head."""
    spec = SIZES[size]
    h, inter = spec.hidden_size, spec.intermediate_size or 4 * spec.hidden_size
    kv = h // spec.num_heads * spec.num_kv_heads
    return [(h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter)] * spec.num_layers + [(spec.vocab_size, h)]


def model_shapes(path: str) -> list[tuple[int, int]]:
    """The same for a model folder's config.json (a dense decoder: hidden, intermediate, heads, head_dim, layers,
    vocabulary)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", config)
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)] * config.num_hidden_layers + [(config.vocab_size, h)]


def repack_times(kernel, weights: list[torch.Tensor], panels: list, repeats: int) -> dict:
    """Milliseconds to re-pack every weight for the C kernel, as the rollout does after each weight update: into new
    tensors, and into the old ones (the kernel's pack(..., out=)); alternated, each one's best of 2 * repeats rounds."""
    best = {"new_tensors": float("inf"), "in_place": float("inf")}
    for _ in range(2 * repeats):
        for name in best:
            start = time.perf_counter()
            fresh = [kernel.pack(w, out=p if name == "in_place" else None) for w, p in zip(weights, panels)]
            best[name] = min(best[name], time.perf_counter() - start)
            del fresh
    return {name: round(s * 1e3, 2) for name, s in best.items()}


if __name__ == "__main__":
    main()
