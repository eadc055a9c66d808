"""Activation memory of the actor's forward+backward with a memory switch off and on: gradient checkpointing
(actor_rollout_ref.model.enable_gradient_checkpointing, the default --switch) or the fused log-probs
(actor_rollout_ref.model.use_fused_kernels: each chunk's logits recomputed in backward, hf_model.py).

Each case runs in a fresh process on the ~21M-parameter "mid" model (or --model-path): build the actor engine, take
the RSS, run one forward+backward over one micro-batch of `--rows` rows of `--seq` tokens (with the entropy, as an
entropy bonus computes it, under --entropy), and report the peak RSS above that baseline (ru_maxrss: activations,
gradients and the autograd graph) and the step time. Gradient checkpointing recomputes each decoder layer in backward,
so it trades a second forward for not keeping the layers' activations; the fused log-probs recompute the output head
per chunk of tokens, for not keeping every chunk's [tokens, vocabulary] logits (which matter at a real vocabulary:
use --model-path with one).

    .venv/bin/python benchmarks/activation_memory.py [--rows 8] [--seq 512] [--model-path DIR]
    .venv/bin/python benchmarks/activation_memory.py --switch fused_kernels --entropy --model-path DIR
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


def pg_loss(micro, outputs: dict):
    """A policy-gradient loss over the response tokens, with an entropy bonus where the forward computed it."""
    mask = micro.batch["response_mask"].float()
    total = micro.meta_info["global_num_tokens"]
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / total
    if "entropy" in outputs:
        loss = loss - 0.01 * (outputs["entropy"] * mask).sum() / total
    return loss, {}


SWITCHES = {"gradient_checkpointing": "gradient_checkpointing", "fused_kernels": "logits_checkpointing"}


def run_case(switch: str, on: bool, model_path: str, rows: int, seq: int, entropy: bool) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests", "engines"))
    from test_train_distributed import make_batch

    from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    actor = FSDPEngine(EngineConfig(model_path=model_path, optim=OptimConfig(lr=1e-3), micro_batch_size_per_gpu=rows,
                                    **{SWITCHES[switch]: on}))
    batch = make_batch(rows=rows, prompt_len=seq // 4, response_len=seq - seq // 4, seed=0)
    batch.meta_info["calculate_entropy"] = entropy
    actor.forward_backward(batch[:1], pg_loss)  # warm-up: gradient buffers exist before the baseline
    baseline = psutil.Process().memory_info().rss
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    actor.forward_backward(batch, pg_loss)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = int(batch.batch["attention_mask"].sum())
    return {switch: on, "tokens": tokens, "step_s": seconds,
            "baseline_rss_bytes": baseline, "peak_rss_bytes": peak,
            "peak_above_baseline_bytes": peak - max(baseline, 0) if peak > peak_before else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--model-path", help="a Hugging Face model folder (default: a random-init mid model)")
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="gradient_checkpointing")
    parser.add_argument("--entropy", action="store_true", help="the forward also computes the entropy")
    parser.add_argument("--case", choices=("on", "off"))
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.switch, args.case == "on", args.model_path, args.rows, args.seq,
                                  args.entropy)))
        return
    from benchmarks._common import document, emit
    from hybridflow.engines.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or write_tiny_model(tmp, spec="mid", seed=0)
        results = {}
        for case in ("off", "on"):
            out = subprocess.check_output(
                [sys.executable, __file__, "--case", case, "--model-path", path, "--rows", str(args.rows),
                 "--seq", str(args.seq), "--switch", args.switch, *(["--entropy"] if args.entropy else [])],
                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            results[case] = json.loads(out.strip().splitlines()[-1])
    off, on = results["off"]["peak_above_baseline_bytes"], results["on"]["peak_above_baseline_bytes"]
    emit(document("activation_memory", {"model": args.model_path or "mid", "rows": args.rows, "seq": args.seq,
                                        "switch": args.switch, "entropy": args.entropy},
                  {"cases": list(results.values()),
                   "activation_memory_ratio_on_over_off": on / off if on and off else None,
                   "step_time_ratio_on_over_off": results["on"]["step_s"] / results["off"]["step_s"]}))


if __name__ == "__main__":
    main()
