"""Native rollout variants against each other in one process, runs alternated (A B C, C B A, ...); prints one JSON.

    .venv/bin/python benchmarks/native_decode_ab.py --arch qwen2 --dtype bf16 --variants hf,native,native+prepack=false
    .venv/bin/python benchmarks/native_decode_ab.py --arch qwen2 --variants native,native+decode=compiled
    .venv/bin/python benchmarks/native_decode_ab.py --arch qwen3_moe --variants hf,native,native+experts=dense
    .venv/bin/python benchmarks/native_decode_ab.py --size tiny --batch 16 --variants native+one_call=false,native

On a shared machine one process with every variant warm, measured in alternation, gives steadier ratios than
separate runs. A variant is ``hf`` or ``native`` plus ``+key=value`` engine kwargs (``decode=compiled``,
``prepack=false``); ``+experts=dense`` runs a MoE model's routed experts with F.linear on the fused tensors (the
dispatch before the experts were packed), everything else unchanged; ``+one_call=false`` runs an fp32 decode step's
layers as two C calls each with torch's activation between them (cpu_decode_layer.py's ``layers``) instead of the
whole step as one call (its ``step``); ``+layers=eager`` runs the eager step without that driver (every op from
Python, as a routed-experts model's steps ran before the driver took them). --batch rows: --batch / --n prompts (rollout_throughput.py's) x --n samples
(default 64 x 1), 64 new tokens at temperature 1; ``first_call_s`` is each variant's first generate call (a compiled
step compiles there), ``best_new_tokens_per_s`` the best of --rounds calls after it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rollout_throughput import git_commit, make_prompts
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.engines.rollout.moe import dense_experts
from hybridflow.engines.tiny import TINY_ARCHITECTURES, write_tiny_model


class _TwoCallsALayer:
    """A decode-layer driver whose whole-step call never applies: the steps run `layers` (two calls a layer)."""

    def __init__(self, kernel):
        self._kernel = kernel

    def step(self, *args, **kwargs):
        return None

    def __getattr__(self, name):
        return getattr(self._kernel, name)


def build(variant: str, path: str, dtype: str, threads: int):
    name, *options = variant.split("+")
    kwargs = {}
    for option in options:
        key, _, value = option.partition("=")
        kwargs[key] = {"true": True, "false": False}.get(value.lower(), value)
    experts = kwargs.pop("experts", None)
    one_call = kwargs.pop("one_call", True)
    eager = kwargs.pop("layers", None) == "eager"
    engine = create_rollout_engine(name, path, dtype=dtype, num_threads=threads, **kwargs)
    if not one_call and engine.model.layer_kernel is not None:
        engine.model.layer_kernel = _TwoCallsALayer(engine.model.layer_kernel)
    if eager:
        engine.model.layer_kernel = None
    if experts == "dense":
        model = engine.model
        model._expert_mlp = lambda li: dense_experts(model.layers[li]["experts_gate_up"],
                                                     model.layers[li]["experts_down"], model.act)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen2", choices=TINY_ARCHITECTURES)
    parser.add_argument("--size", default="mid")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--variants", default="hf,native")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (batch / n distinct prompts)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(os.path.join(tmp, args.size), args.size, seed=0, arch=args.arch)
        engines, first = {}, {}
        for variant in variants:
            engine = build(variant, path, args.dtype, args.threads)
            prompts = make_prompts(engine.tokenizer, args.batch // args.n, 16, 32, seed=args.batch)
            start = time.perf_counter()
            engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=99,
                                                   n=args.n))
            first[variant] = round(time.perf_counter() - start, 2)
            engines[variant] = (engine, prompts)
        best = dict.fromkeys(variants, 0.0)
        for r in range(args.rounds):
            for variant in variants if r % 2 == 0 else variants[::-1]:
                engine, prompts = engines[variant]
                start = time.perf_counter()
                out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens,
                                                                      seed=r, n=args.n))
                rate = int(out.batch["response_mask"].sum()) / (time.perf_counter() - start)
                best[variant] = max(best[variant], round(rate, 1))
    ratios = {f"{v}_vs_{variants[0]}": round(best[v] / best[variants[0]], 2) for v in variants[1:]}
    print(json.dumps({"benchmark": "native_decode_ab", "git_commit": git_commit(), "config": vars(args),
                      "load_average": os.getloadavg(), "first_call_s": first, "best_new_tokens_per_s": best,
                      "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
