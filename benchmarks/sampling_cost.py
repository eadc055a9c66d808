"""Cost of one decode step's sampling (engines/rollout/sampling.py) at real vocabulary sizes; prints one JSON document.

    python benchmarks/sampling_cost.py [--vocab 288,49152,151936] [--rows 16,64] [--threads 2]

Per (vocabulary, rows): milliseconds per ``sample_tokens`` call on random logits: plain sampling at temperature 1
and 0.7, greedy, top-p 0.9 and top-k 50, each on the C kernel of cpu_sampling.py (the default on CPU) and on torch's
ops (``kernel=False``); top-p and top-k also on logits shaped like a language model's (``zipf_logits``),
with the draws from a ``StepUniforms`` table as the native engine takes them, and the per-step hashing alone
(``uniform_from_keys``), which the table replaces. The vocabularies are the tiny models' (288), SmolLM2's (49,152)
and Qwen3's (151,936). Medians of --repeats timings of --calls calls each.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import StdoutToStderr, document, log, ms_per_call
from hybridflow import device
from hybridflow.engines.rollout.sampling import StepUniforms, row_keys, sample_tokens, uniform_from_keys


def zipf_logits(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Logits shaped like a language model's: the token of rank r (a random order per row) has probability
    proportional to r^-1.65, so a few tokens hold most of the mass and a long tail the rest."""
    ranks = torch.stack([torch.randperm(vocab, generator=g) for _ in range(rows)]) + 1
    return -1.65 * ranks.float().log()


def measure(vocab: int, rows: int, calls: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(vocab + rows)
    flat = torch.randn(rows, vocab, generator=g) * 3
    peaked = zipf_logits(rows, vocab, g)
    logits = flat
    keys = row_keys(0, torch.arange(rows) // 4, torch.arange(rows) % 4)
    draws = StepUniforms(keys, steps=1 << 20)
    step = [0]

    def sample(top_p: float, top_k: int = -1, kernel: bool = True, temperature: float = 1.0, greedy: bool = False,
               rows_of=None):
        def call():
            step[0] += 1
            sample_tokens(logits if rows_of is None else rows_of, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, keys=None,
                          step=step[0], uniforms=draws.at(step[0]), kernel=kernel)
        return call

    # plain sampling (temperature 1 and 0.7) and greedy on the C kernel (cpu_sampling.py) and on torch's ops,
    # alternated over two rounds, the better of the two kept
    paths = {}
    for _ in range(2):
        for name, kw in (("sample", {}), ("sample_t0.7", {"temperature": 0.7}), ("greedy", {"greedy": True})):
            for path in ("kernel", "torch"):
                ms = ms_per_call(sample(1.0, kernel=path == "kernel", **kw), calls, repeats)
                key = f"{name}_{path}_ms"
                paths[key] = min(ms, paths.get(key, ms))
    # top-p 0.9 and top-k 50, C against torch's ops, on the random logits (standard deviation 3: flat, top-p keeps
    # thousands of tokens) and on language-model-shaped ones (zipf_logits), alternated, the better of two rounds
    few = max(1, calls // 4)
    for _ in range(2):
        for name, kw in (("top_p_0.9", {"top_p": 0.9}), ("top_k_50", {"top_p": 1.0, "top_k": 50}),
                         ("zipf_top_p_0.9", {"top_p": 0.9, "rows_of": peaked}),
                         ("zipf_top_k_50", {"top_p": 1.0, "top_k": 50, "rows_of": peaked})):
            for path in ("kernel", "torch"):
                ms = ms_per_call(sample(kernel=path == "kernel", **kw), few, repeats)
                key = f"{name}_{path}_ms"
                paths[key] = min(ms, paths.get(key, ms))
    return {
        **paths,
        "sample_ms": ms_per_call(sample(1.0), calls, repeats),
        "per_step_hashing_ms": ms_per_call(lambda: uniform_from_keys(keys, 7), calls, repeats),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", default="288,49152,151936")
    p.add_argument("--rows", default="16,64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device.keep_freed_host_memory()  # as the engines run
    with StdoutToStderr() as out:
        results = {}
        for vocab in [int(v) for v in args.vocab.split(",") if v]:
            for rows in [int(r) for r in args.rows.split(",") if r]:
                log(f"vocabulary {vocab}, {rows} rows")
                results[f"{vocab}x{rows}"] = measure(vocab, rows, args.calls, args.repeats)
        out.emit(document("sampling_cost", vars(args), results))


if __name__ == "__main__":
    main()
