"""Seconds of the training engine's two passes over a batch on one rank, as one JSON document: the forward-only
log-prob pass (the reference's and the old policy's, ``compute_log_prob``) and the actor's forward+backward, each with
and without the entropy. At a real vocabulary these passes spend much of their time in the output head and the
log-softmax over [tokens, vocabulary] (hf_model.py ``HeadOnPositions``).

    .venv/bin/python benchmarks/log_prob_pass.py --model-path DIR [--rows 8] [--prompt-len 128] [--response-len 384]
    .venv/bin/python benchmarks/log_prob_pass.py --model-path DIR --fused-kernels    # actor_rollout_ref.model.use_fused_kernels

Best of --rounds calls after one warm-up call each (the passes of one round alternate).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "engines")]
from test_train_distributed import make_batch  # noqa: E402

from benchmarks.activation_memory import pg_loss  # noqa: E402
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fused-kernels", action="store_true", help="the actor recomputes logits in backward")
    args = parser.parse_args()
    from benchmarks._common import StdoutToStderr, document

    torch.set_num_threads(args.threads)
    with StdoutToStderr() as out:
        batch = make_batch(rows=args.rows, prompt_len=args.prompt_len, response_len=args.response_len, seed=0)
        kwargs = {"logits_checkpointing": True} if args.fused_kernels else {}
        ref = FSDPEngine(EngineConfig(model_path=args.model_path, role="ref", micro_batch_size_per_gpu=args.rows))
        actor = FSDPEngine(EngineConfig(model_path=args.model_path, optim=OptimConfig(lr=1e-6),
                                        micro_batch_size_per_gpu=args.rows, **kwargs))

        def log_probs(entropy: bool):
            return lambda: ref.compute_log_prob(batch, temperature=1.0, calculate_entropy=entropy)

        def forward_backward(entropy: bool):
            def call():
                batch.meta_info["calculate_entropy"] = entropy
                actor.forward_backward(batch, pg_loss)
            return call

        passes = {"log_probs_s": log_probs(False), "log_probs_entropy_s": log_probs(True),
                  "forward_backward_s": forward_backward(False),
                  "forward_backward_entropy_s": forward_backward(True)}
        for call in passes.values():
            call()
        times: dict[str, list[float]] = {name: [] for name in passes}
        for _ in range(args.rounds):
            for name, call in passes.items():
                start = time.perf_counter()
                call()
                times[name].append(round(time.perf_counter() - start, 3))
        results = {name: min(t) for name, t in times.items()} | {"all_s": times,
                                                                 "tokens": int(batch.batch["attention_mask"].sum())}
        out.emit(document("log_prob_pass", vars(args), results))


if __name__ == "__main__":
    main()
