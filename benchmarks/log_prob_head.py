"""The training engine's log-probs from a chunk of logits, C path against torch's formula; prints one JSON document.

    python benchmarks/log_prob_head.py [--shapes 1024x288,160x49152,48x151936] [--threads 2]

Per [rows x vocabulary] shape: milliseconds of ``hf_model.log_probs_from_logits`` on random fp32 logits, its forward
alone (the reference and old-log-prob passes) and forward + backward (the update), on the C path (cpu_sampling.c's
last section, the default on CPU) and on torch's ``logits[target] - logsumexp(logits)`` with autograd (the path on
other devices); then the same with the entropy (``log_probs_and_entropy``: the C call's one pass, against torch's
shared log-softmax), as the old-log-prob pass and an entropy bonus take it. The shapes are the tiny model's update
(1,024 response tokens of 288) and one chunk of SmolLM2's (49,152) and of Qwen3's (151,936) vocabulary, at the rows
the engine's head takes per chunk on CPU (160 and 48: hf_model._CHUNK_LOGITS). The paths alternate over --rounds
rounds; the best of each is kept, with the max |difference| between the two log-prob paths' values and gradients.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import StdoutToStderr, document, log, ms_per_call
from hybridflow import device
from hybridflow.engines import hf_model


def _torch_formula(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _torch_with_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """hf_model.log_probs_and_entropy's torch path (one shared log-softmax), summed into one output to backward."""
    log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return log_p.gather(-1, targets[:, None]).squeeze(-1) - (log_p.exp() * log_p).sum(dim=-1)


def _c_with_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    log_p, entropy = hf_model.log_probs_and_entropy(logits, targets)
    return log_p + entropy


def measure(rows: int, vocab: int, calls: int, repeats: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 3).requires_grad_(True)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.randn(rows, generator=g)
    paths = {"c": hf_model.log_probs_from_logits, "torch": _torch_formula, "c_entropy": _c_with_entropy,
             "torch_entropy": _torch_with_entropy}

    def forward(fn):
        def call():
            with torch.no_grad():
                fn(logits, targets)
        return call

    def update(fn):
        def call():
            logits.grad = None
            fn(logits, targets).backward(weights)
        return call

    best: dict[str, float] = {}
    for r in range(rounds):
        for name in paths if r % 2 == 0 else list(paths)[::-1]:
            for stage, make in (("forward", forward), ("forward_backward", update)):
                key = f"{stage}_{name}_ms"
                ms = ms_per_call(make(paths[name]), calls, repeats)
                best[key] = min(ms, best.get(key, ms))
    c_lp = hf_model.log_probs_from_logits(logits, targets)
    torch_lp = _torch_formula(logits, targets)
    (c_grad,) = torch.autograd.grad(c_lp, logits, weights)
    (torch_grad,) = torch.autograd.grad(torch_lp, logits, weights)
    return {
        **best,
        "forward_speedup": round(best["forward_torch_ms"] / best["forward_c_ms"], 2),
        "forward_backward_speedup": round(best["forward_backward_torch_ms"] / best["forward_backward_c_ms"], 2),
        "with_entropy_forward_speedup": round(best["forward_torch_entropy_ms"] / best["forward_c_entropy_ms"], 2),
        "with_entropy_forward_backward_speedup": round(
            best["forward_backward_torch_entropy_ms"] / best["forward_backward_c_entropy_ms"], 2),
        "max_abs_log_prob_difference": float((c_lp - torch_lp).abs().max()),
        "max_abs_gradient_difference": float((c_grad - torch_grad).abs().max()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1024x288,160x49152,48x151936")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device.keep_freed_host_memory()  # as the engines run
    probe = torch.zeros(1, 2)
    if not hf_model.log_prob_kernel_applies(probe):
        raise SystemExit("log_prob_head: the C path does not run here (no C compiler?): nothing to compare")
    with StdoutToStderr() as out:
        results = {}
        for shape in [s for s in args.shapes.split(",") if s]:
            rows, vocab = (int(v) for v in shape.split("x"))
            log(f"{rows} rows x {vocab} tokens")
            results[shape] = measure(rows, vocab, args.calls, args.repeats, args.rounds)
        out.emit(document("log_prob_head", vars(args), results))


if __name__ == "__main__":
    main()
