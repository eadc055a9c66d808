"""How a hybridflow GRPO step scales with the batch and the response length (tiny model); prints one JSON document.

    .venv/bin/python benchmarks/scaling.py --quick      # 3 steps per point (1 warm-up)
    .venv/bin/python benchmarks/scaling.py              # 5 steps per point
    .venv/bin/python benchmarks/scaling.py --size mid --backend local

Two sweeps on the "tiny" random-init Qwen2 (eos unreachable, so every sample is exactly the response length):
  * batch: 1, 2, 4, 8 prompts x n=4 samples = 4..32 completions per step, at --response-length tokens;
  * response length: 16, 32, 64, 128 tokens at --prompts x n = 16 completions.
Each point is one `hybridflow train` run (in this process; Ray started once) with the same GRPO settings as
rl_step_vs_trl.py (KL loss 0.04, one optimizer step and one micro-batch per step). Reported per point: median step
time and per-stage times over the steps after warm-up, and the peak resident memory (VmHWM) of each worker process
and of the driver. Per sweep: the least-squares line step_s = slope * x + intercept and its R^2 (a straight line
with R^2 near 1 means no hidden super-linear cost in that direction on this range).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    PeakMemoryMonitor,
    StdoutToStderr,
    document,
    grpo_overrides,
    linear_fit,
    log,
    median,
    run_inprocess,
    stage_breakdown,
    write_benchmark_model,
)


def measure_point(model_path: str, workdir: str, args, prompts: int, length: int) -> dict:
    run_dir = os.path.join(workdir, f"run_p{prompts}_r{length}")
    overrides = grpo_overrides(
        model_path=model_path, run_dir=run_dir, prompts_per_step=prompts, n=args.n, max_response_length=length,
        steps=args.steps, threads=args.threads, backend=args.backend,
    )
    log(f"point: {prompts} prompts x {args.n} samples, {length} tokens")
    with PeakMemoryMonitor() as mem:
        rows = run_inprocess(overrides)[args.warmup :]
    completions = prompts * args.n
    step = median([r["timing/step"] for r in rows])
    procs = mem.report()
    return {
        "prompts": prompts,
        "completions": completions,
        "response_length": length,
        "generated_tokens_per_step": round(median([r["response_length/mean"] for r in rows]) * completions),
        "median_step_s": round(step, 4),
        "step_times_s": [round(r["timing/step"], 3) for r in rows],
        "generated_tokens_per_s": round(completions * length / step, 1),
        "breakdown_median_s": stage_breakdown(rows),
        "peak_rss_mb": {
            "workers": [p for p in procs if p["process"] != "driver"],
            "driver_so_far": next((p["peak_rss_mb"] for p in procs if p["process"] == "driver"), None),
        },
    }


def fit(points: list[dict], key: str) -> dict:
    xs = [p[key] for p in points]
    out = {"x": key, "step": _rounded(linear_fit(xs, [p["median_step_s"] for p in points]))}
    for stage in ("generate", "update_actor", "ref"):
        ys = [p["breakdown_median_s"].get(f"{stage}_s") for p in points]
        if all(y is not None for y in ys):
            out[stage] = _rounded(linear_fit(xs, ys))
    return out


def _rounded(f: dict) -> dict:
    return {"slope_s": round(f["slope"], 6), "intercept_s": round(f["intercept"], 4), "r2": round(f["r2"], 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 steps per point, 1 of them warm-up")
    p.add_argument("--size", default="tiny")
    p.add_argument("--backend", default="ray", choices=["ray", "local"])
    p.add_argument("--batch-prompts", default="1,2,4,8", help="prompts per step of the batch sweep")
    p.add_argument("--lengths", default="16,32,64,128", help="response lengths of the length sweep")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step of the length sweep")
    p.add_argument("--response-length", type=int, default=64, help="response length of the batch sweep")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    if args.quick:
        args.steps = 3
    batch_prompts = [int(x) for x in args.batch_prompts.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    with StdoutToStderr() as out, tempfile.TemporaryDirectory(prefix="scaling_") as workdir:
        model_path = write_benchmark_model(os.path.join(workdir, "model"), args.size)
        cache: dict[tuple[int, int], dict] = {}

        def point(prompts: int, length: int) -> dict:
            if (prompts, length) not in cache:
                cache[(prompts, length)] = measure_point(model_path, workdir, args, prompts, length)
            return cache[(prompts, length)]

        batch_sweep = [point(b, args.response_length) for b in batch_prompts]
        length_sweep = [point(args.prompts, r) for r in lengths]
        results = {
            "batch_sweep": batch_sweep,
            "length_sweep": length_sweep,
            "fit_step_vs_completions": fit(batch_sweep, "completions"),
            "fit_step_vs_response_length": fit(length_sweep, "response_length"),
            "peak_worker_rss_mb": max(
                (w["peak_rss_mb"] for pt in cache.values() for w in pt["peak_rss_mb"]["workers"]), default=None
            ),
        }
        config = {
            "quick": args.quick, "size": args.size, "backend": args.backend, "ranks": 1, "threads": args.threads,
            "samples_per_prompt": args.n, "batch_sweep_prompts": batch_prompts,
            "batch_sweep_response_length": args.response_length, "length_sweep_lengths": lengths,
            "length_sweep_prompts": args.prompts, "steps_per_point": args.steps, "warmup_steps_dropped": args.warmup,
            "algorithm": "GRPO, KL loss 0.04 (low_var_kl), one optimizer step and one micro-batch per step, fp32",
        }
        out.emit(document("scaling", config, results))


if __name__ == "__main__":
    main()
