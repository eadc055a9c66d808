"""Activation memory with and without gradient checkpointing (actor_rollout_ref.model.enable_gradient_checkpointing).

Each case runs in a fresh process on the ~21M-parameter "mid" model (or --model-path): build the actor engine, take
the RSS, run one forward+backward over one micro-batch of `--rows` rows of `--seq` tokens, and report the peak RSS
above that baseline (ru_maxrss: activations, gradients and the autograd graph) and the step time. Checkpointing
recomputes each decoder layer in backward, so it trades a second forward for not keeping the layers' activations.

    .venv/bin/python benchmarks/activation_memory.py [--rows 8] [--seq 512] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import psutil
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def run_case(checkpointing: bool, model_path: str, rows: int, seq: int) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests", "engines"))
    from test_train_distributed import make_batch, seq_mean_pg_loss

    from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    actor = FSDPEngine(EngineConfig(model_path=model_path, optim=OptimConfig(lr=1e-3), micro_batch_size_per_gpu=rows,
                                    gradient_checkpointing=checkpointing))
    batch = make_batch(rows=rows, prompt_len=seq // 4, response_len=seq - seq // 4, seed=0)
    actor.forward_backward(batch[:1], seq_mean_pg_loss)  # warm-up: gradient buffers exist before the baseline
    baseline = psutil.Process().memory_info().rss
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    actor.forward_backward(batch, seq_mean_pg_loss)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = int(batch.batch["attention_mask"].sum())
    return {"gradient_checkpointing": checkpointing, "tokens": tokens, "step_s": seconds,
            "baseline_rss_bytes": baseline, "peak_rss_bytes": peak,
            "peak_above_baseline_bytes": peak - max(baseline, 0) if peak > peak_before else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--model-path", help="a Hugging Face model folder (default: a random-init mid model)")
    parser.add_argument("--case", choices=("on", "off"))
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case == "on", args.model_path, args.rows, args.seq)))
        return
    from benchmarks._common import document, emit
    from hybridflow.engines.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or write_tiny_model(tmp, spec="mid", seed=0)
        results = {}
        for case in ("off", "on"):
            out = subprocess.check_output(
                [sys.executable, __file__, "--case", case, "--model-path", path, "--rows", str(args.rows),
                 "--seq", str(args.seq)], text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            results[case] = json.loads(out.strip().splitlines()[-1])
    off, on = results["off"]["peak_above_baseline_bytes"], results["on"]["peak_above_baseline_bytes"]
    emit(document("activation_memory", {"model": args.model_path or "mid", "rows": args.rows, "seq": args.seq},
                  {"cases": list(results.values()),
                   "activation_memory_ratio_on_over_off": on / off if on and off else None,
                   "step_time_ratio_on_over_off": results["on"]["step_s"] / results["off"]["step_s"]}))


if __name__ == "__main__":
    main()
