"""Sequence packing (engines/packing.py) against length bucketing (micro_batch.py) on rows whose lengths vary 10x,
per phase (forward-only log-probs, training step) and thread count; prints one JSON document.

    .venv/bin/python benchmarks/packing_vs_bucketing.py                      # mid, 32 rows, threads 1,2
    .venv/bin/python benchmarks/packing_vs_bucketing.py --size tiny --rows 16 --threads 2 --repeats 2

For each micro-batching mode (fixed rows per micro-batch, token budget) and each thread count, the two layouts run
alternately (A B B A ...), --repeats times each; reported are the median seconds, real tokens/s, the ratio
packed / bucketed, the padding the bucketed layout computes, and MFU = 6 N tokens / time / measured matmul peak (train
step) or 2 N tokens / time / peak (log-probs). Both layouts give the same results (tests/engines/test_packing.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import document, emit, log

from hybridflow.common.metrics import measure_peak_flops
from hybridflow.engines import micro_batch as mb
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.tiny import write_tiny_model
from hybridflow.protocol import DataProto


def varied_batch(rows: int, max_len: int, ratio: float, seed: int = 0) -> DataProto:
    """Rollout-layout rows whose real lengths spread evenly over [max_len / ratio, max_len] (prompt ~1/8 of it)."""
    g = torch.Generator().manual_seed(seed)
    lo = max(2, int(max_len / ratio))
    totals = torch.linspace(lo, max_len, rows).round().long()[torch.randperm(rows, generator=g)]
    prompt_width, response_width = max_len // 8, max_len - max_len // 8
    prompt_lens = (totals // 8).clamp(min=1, max=prompt_width)
    resp_lens = (totals - prompt_lens).clamp(min=1, max=response_width)
    seq = prompt_width + response_width
    mask = torch.zeros(rows, seq, dtype=torch.long)
    for i in range(rows):
        mask[i, prompt_width - prompt_lens[i] : prompt_width + resp_lens[i]] = 1
    ids = torch.randint(4, 250, (rows, seq), generator=g).masked_fill(mask == 0, 0)
    response_mask = mask[:, prompt_width:]
    return DataProto.from_dict(
        {
            "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, prompt_width:], "response_mask": response_mask,
            "advantages": torch.randn(rows, response_width, generator=g) * response_mask,
        },
        meta_info={"temperature": 1.0, "calculate_entropy": True},
    )


def pg_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
    mask = micro.batch["response_mask"].float()
    total = micro.meta_info["global_num_tokens"]
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / total
    return loss - 0.01 * (outputs["entropy"] * mask).sum() / total, {}


def timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="mid")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-len", type=int, default=320, help="longest row (prompt + response), tokens")
    p.add_argument("--ratio", type=float, default=10.0, help="longest / shortest row")
    p.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch in the fixed mode")
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget per micro-batch in the dynamic mode")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    data = varied_batch(args.rows, args.max_len, args.ratio)
    starts, ends = mb.real_token_spans(data.batch["attention_mask"])
    lengths = (ends - starts).tolist()
    real_tokens = sum(lengths)
    modes = {
        "fixed_rows": {"micro_batch_size_per_gpu": args.micro_batch},
        "token_budget": {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": args.max_tokens},
    }
    results: dict = {
        "lengths": {"min": min(lengths), "max": max(lengths), "ratio": round(max(lengths) / min(lengths), 1),
                    "real_tokens": real_tokens},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(os.path.join(tmp, args.size), args.size, seed=0)
        for threads in [int(t) for t in args.threads.split(",") if t]:
            torch.set_num_threads(threads)
            peak = max(measure_peak_flops(device="cpu", size=1024, repeats=5) for _ in range(2))
            per_threads: dict = {"matmul_peak_gflops": round(peak / 1e9, 1)}
            for mode, overrides in modes.items():
                engines = {
                    layout: FSDPEngine(EngineConfig(model_path=path, use_sequence_packing=layout == "packed",
                                                    optim=OptimConfig(lr=1e-6), **overrides))
                    for layout in ("bucketed", "packed")
                }
                n_params = sum(p.numel() for p in engines["bucketed"].model.parameters())
                groups = engines["bucketed"]._plan(data)
                times: dict = {(layout, phase): [] for layout in engines for phase in ("log_prob", "train_step")}
                for eng in engines.values():  # warm-up: allocator, kernels for these shapes
                    eng.compute_log_prob(data, temperature=1.0, calculate_entropy=True)
                    eng.train_step(data, pg_loss)
                for r in range(args.repeats):
                    order = list(engines) if r % 2 == 0 else list(reversed(engines))
                    for layout in order:
                        eng = engines[layout]
                        times[(layout, "log_prob")].append(
                            timed(eng.compute_log_prob, data, temperature=1.0, calculate_entropy=True))
                        times[(layout, "train_step")].append(timed(eng.train_step, data, pg_loss))
                out: dict = {"micro_batches": len(groups), "bucketed_padding": mb.padding_stats(lengths, groups)}
                for phase, flops_per_token in (("log_prob", 2.0), ("train_step", 6.0)):
                    row = {}
                    for layout in engines:
                        sec = statistics.median(times[(layout, phase)])
                        row[layout] = {
                            "median_s": round(sec, 4), "all_s": [round(t, 4) for t in times[(layout, phase)]],
                            "tokens_per_s": round(real_tokens / sec, 1),
                            "mfu": round(flops_per_token * n_params * real_tokens / sec / peak, 3),
                        }
                    row["packed_over_bucketed"] = round(row["packed"]["median_s"] / row["bucketed"]["median_s"], 3)
                    out[phase] = row
                per_threads[mode] = out
                log(f"threads={threads} {mode}: train packed/bucketed {out['train_step']['packed_over_bucketed']}")
            results[f"threads_{threads}"] = per_threads
    config = vars(args) | {"model_params": n_params, "dtype": "fp32"}
    emit(document("packing_vs_bucketing", config, results))


if __name__ == "__main__":
    main()
