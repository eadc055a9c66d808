"""Training throughput of FSDPEngine (world size 1) on the ~21M-parameter "mid" model, as one JSON document.

Reports training tokens/s (real tokens: prompt + response, no padding), model FLOPs utilisation
MFU = 6 * params * tokens / time / peak, where the peak is measured here on large square matrices (same dtype, same
thread count; common/metrics.matmul_peaks: the better of torch.matmul and, on CPU, oneDNN), the minor page faults
and kernel CPU seconds per timed step (fresh host pages; ``HYBRIDFLOW_KEEP_FREED_MEMORY=0`` runs it with glibc's
defaults, device.keep_freed_host_memory), and the padding waste of the micro-batches on a batch whose response
lengths vary 4x.

    .venv/bin/python benchmarks/train_throughput.py [--quick] [--threads N] [--dtypes fp32,bf16]
    .venv/bin/python benchmarks/train_throughput.py --dtypes fp32 --linears onednn,torch   # one after the other
    .venv/bin/python benchmarks/train_throughput.py --dtypes fp32 --linears-ab 6   # onednn_train.py A/B, alternated
    .venv/bin/python benchmarks/train_throughput.py --dtypes fp32 --fused-ops-ab 4   # cpu_train_ops.py A/B
    .venv/bin/python benchmarks/train_throughput.py --dtypes fp32 --attention-ab 4   # cpu_flash_attention.py A/B

--fused-ops-ab K builds two engines on the same model, with and without the fused norm/rotary/SwiGLU ops
(EngineConfig.fused_cpu_ops), and alternates their train steps K rounds (A B, B A, ...): median step seconds and
their ratio, and whether both engines' weights are still equal to rounding. --linears-ab K does the same for the fp32
linears on oneDNN and on torch's matmuls (EngineConfig.onednn_linears), --attention-ab K for the packed attention as
the CPU kernel and as torch's SDPA per row (EngineConfig.cpu_flash_attention).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import torch
from _common import cpu_flags

from hybridflow import device
from hybridflow.common.metrics import matmul_peaks
from hybridflow.engines import micro_batch as mb
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.tiny import SIZES, write_tiny_model
from hybridflow.protocol import DataProto

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rollout_batch(rows: int, prompt_len: int, response_len: int, seed: int = 0) -> DataProto:
    """Left-padded prompts (prompt_len/4..prompt_len), right-padded responses (response_len/4..response_len: 4x)."""
    g = torch.Generator().manual_seed(seed)
    seq = prompt_len + response_len
    mask = torch.zeros(rows, seq, dtype=torch.long)
    prompt_lens = torch.randint(prompt_len // 4, prompt_len + 1, (rows,), generator=g)
    resp_lens = torch.randint(response_len // 4, response_len + 1, (rows,), generator=g)
    for i in range(rows):
        mask[i, prompt_len - prompt_lens[i] : prompt_len + resp_lens[i]] = 1
    ids = torch.randint(4, 250, (rows, seq), generator=g).masked_fill(mask == 0, 0)
    response_mask = mask[:, prompt_len:]
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, prompt_len:],
            "response_mask": response_mask,
            "advantages": torch.randn(rows, response_len, generator=g) * response_mask,
        },
        meta_info={"temperature": 1.0, "calculate_entropy": False},
    )


def pg_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
    mask = micro.batch["response_mask"].float()
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["global_num_tokens"]
    return loss, {}


def padding_report(data: DataProto, max_tokens: int, micro_batch_size: int) -> dict:
    starts, ends = mb.real_token_spans(data.batch["attention_mask"])
    lengths = (ends - starts).tolist()
    width = data.batch["attention_mask"].shape[1]
    budget = mb.token_budget_micro_batches(lengths, max_tokens)
    return {
        "response_length_ratio": _response_ratio(data),
        # what a bucketed engine computes under the budget (a packed one computes the real tokens only, in
        # packed_micro_batches' groups)
        "token_budget": {"micro_batches": len(budget), **mb.padding_stats(lengths, budget)},
        "packed_micro_batches": len(mb.packed_micro_batches(lengths, max_tokens)),
        "fixed_sorted": mb.padding_stats(lengths, mb.fixed_size_micro_batches(lengths, micro_batch_size, sort=True)),
        "plain_padded": mb.padding_stats(lengths, [list(range(len(lengths)))], pad_to=width),
    }


def _response_ratio(data: DataProto) -> float:
    lens = data.batch["response_mask"].sum(-1).float()
    return float(lens.max() / lens.min())


def bench_training(path: str, dtype: str, data: DataProto, steps: int, max_tokens: int, checkpointing: bool,
                   packing: bool | None = None, onednn_linears: bool | None = None) -> dict:
    engine = FSDPEngine(
        EngineConfig(
            model_path=path,
            param_dtype=dtype,
            use_dynamic_bsz=True,
            max_tokens_per_micro_batch=max_tokens,
            gradient_checkpointing=checkpointing,
            use_sequence_packing=packing,
            onednn_linears=onednn_linears,
            optim=OptimConfig(lr=1e-5),
        )
    )
    params = sum(p.numel() for p in engine.model.parameters())
    real_tokens = int(data.batch["attention_mask"].sum())
    engine.train_step(data, pg_loss)  # warm-up: allocator, autograd graph shapes
    times = []
    usage = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_step(data, pg_loss)
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    best = min(times)
    return {
        "params": params,
        "packed": engine.packing,
        "micro_batches": len(engine._plan(data)),
        "tokens_per_step": real_tokens,
        "step_seconds": times,
        # fresh pages the process faulted in, and kernel CPU seconds, per timed step (device.keep_freed_host_memory)
        "minor_page_faults_per_step": (after.ru_minflt - usage.ru_minflt) / steps,
        "system_cpu_seconds_per_step": (after.ru_stime - usage.ru_stime) / steps,
        "tokens_per_s": real_tokens / best,
        "model_flops_per_s": 6.0 * params * real_tokens / best,
    }


def alternate(path: str, data: DataProto, rounds: int, max_tokens: int, option: str, labels: tuple[str, str]) -> dict:
    """Train steps of two engines that differ in EngineConfig.`option` (True for the first label, False for the
    second), alternated A B B A ...; their medians, and how far their weights drifted apart."""
    import statistics

    engines = {on: FSDPEngine(EngineConfig(model_path=path, param_dtype="fp32", use_dynamic_bsz=True,
                                           max_tokens_per_micro_batch=max_tokens, optim=OptimConfig(lr=1e-5),
                                           **{option: on}))
               for on in (True, False)}
    for eng in engines.values():
        eng.train_step(data, pg_loss)  # warm-up
    times = {True: [], False: []}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            start = time.perf_counter()
            engines[on].train_step(data, pg_loss)
            times[on].append(time.perf_counter() - start)
    weights = [eng.full_state_dict() for eng in engines.values()]
    drift = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    first, second = statistics.median(times[True]), statistics.median(times[False])
    a, b = labels
    return {"rounds": rounds, f"step_seconds_{a}": times[True], f"step_seconds_{b}": times[False],
            f"median_{a}_s": first, f"median_{b}_s": second, f"{a}_over_{b}": first / second,
            "max_weight_difference_after": drift}


def git_commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny batch, one timed step: a smoke run of the script, not a measurement"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--layout", default="auto", choices=("auto", "packed", "bucketed"),
                        help="micro-batch layout: auto (the engine's default: packed where it applies), packed "
                             "(engines/packing.py) or bucketed by length (micro_batch.py)")
    parser.add_argument("--size", default="mid", choices=sorted(SIZES), help="model size (engines/tiny.py)")
    parser.add_argument("--linears", default="auto",
                        help="comma-separated: auto (the engine's choice), onednn (onednn_train.py), torch (F.linear)")
    parser.add_argument("--fused-ops-ab", type=int, default=0, metavar="K",
                        help="also alternate K train steps with and without the fused CPU ops (cpu_train_ops.py)")
    parser.add_argument("--linears-ab", type=int, default=0, metavar="K",
                        help="also alternate K train steps with oneDNN's and torch's fp32 linears (onednn_train.py)")
    parser.add_argument("--attention-ab", type=int, default=0, metavar="K",
                        help="also alternate K train steps with the CPU attention kernel and with torch's SDPA "
                             "(cpu_flash_attention.py)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    rows = args.rows or (4 if args.quick else 32)
    prompt_len, response_len = (16, 64) if args.quick else (64, 256)
    steps = 1 if args.quick else 3
    mm_size = 512 if args.quick else (8192 if device.is_cuda_available() else 2048)  # a GPU needs a big one for peak
    data = rollout_batch(rows, prompt_len, response_len)

    results: dict = {"padding": padding_report(data, args.max_tokens, micro_batch_size=4)}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(os.path.join(tmp, args.size), args.size, seed=0)
        linears = {"auto": None, "onednn": True, "torch": False}
        for name in args.dtypes.split(","):
            kernels = matmul_peaks(dtype=DTYPES[name], size=mm_size, repeats=3 if args.quick else 5)
            peak = max(kernels.values())
            for choice in args.linears.split(","):
                run = bench_training(path, name, data, steps, args.max_tokens, args.gradient_checkpointing,
                                     {"auto": None, "packed": True, "bucketed": False}[args.layout], linears[choice])
                run["matmul_peak_flops_per_s"] = peak
                run["matmul_peak_by_kernel_flops_per_s"] = kernels
                run["mfu"] = run["model_flops_per_s"] / peak
                results[name if choice == "auto" else f"{name}:{choice}"] = run
        if args.fused_ops_ab:
            results["fused_ops_ab"] = alternate(path, data, args.fused_ops_ab, args.max_tokens, "fused_cpu_ops",
                                                ("fused", "unfused"))
        if args.linears_ab:
            results["linears_ab"] = alternate(path, data, args.linears_ab, args.max_tokens, "onednn_linears",
                                              ("onednn", "torch"))
        if args.attention_ab:
            results["attention_ab"] = alternate(path, data, args.attention_ab, args.max_tokens,
                                                "cpu_flash_attention", ("kernel", "sdpa"))

    import transformers

    report = {
        "benchmark": "train_throughput",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": device.device_name() if not device.is_cuda_available() else torch.cuda.get_device_name(),
            "cpu_flags": cpu_flags(),
        },
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "git_commit": git_commit(),
        "config": {
            "model": args.size,
            "model_spec": vars(SIZES[args.size]),
            "rows": rows,
            "prompt_len": prompt_len,
            "response_len": response_len,
            "timed_steps": steps,
            "max_tokens_per_micro_batch": args.max_tokens,
            "gradient_checkpointing": args.gradient_checkpointing,
            "layout": args.layout,
            "matmul_size": mm_size,
            "quick": args.quick,
            "fused_ops_ab_rounds": args.fused_ops_ab,
            "linears_ab_rounds": args.linears_ab,
            "attention_ab_rounds": args.attention_ab,
        },
        "results": results,
        "goal": "mfu >= 0.70 of the measured matmul peak on mid at 2 threads (issue #22); token-budget padding_waste <= 0.10",
    }
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
