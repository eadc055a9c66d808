"""Where a native decode step goes, as one JSON document: the numbers behind docs/benchmarks.md's rollout analysis.

    .venv/bin/python benchmarks/rollout_profile.py                      # int8 and fp32, 64 prompts x 1 sample
    .venv/bin/python benchmarks/rollout_profile.py --dtypes fp32 --batch 16
    .venv/bin/python benchmarks/rollout_profile.py --dtypes fp32,bf16 --arch llama --threads 1
    .venv/bin/python benchmarks/rollout_profile.py --dtypes fp32 --batch 4 --n 4 --size tiny   # the step's shape

For each dtype, on the mid model (``--size``) with the prompts of rollout_throughput.py:
  * new tokens/s of hf (fp32) and native, best of --repeats generate calls;
  * the share of torch.profiler self-CPU time per group of ops in one generate call: layer matmuls, decode attention
    (torch's matmuls, or the CPU kernel of cpu_attention.py where the engine uses it), everything else;
  * seconds per decode step spent inside the layer matmuls (timed around NativeDecoder._linear), next to the same
    matmuls run alone (rollout_throughput.py's matmul floor);
  * a diagnostic: native tokens/s with the decode attention (matmuls or kernel) replaced by zeros of the right shape
    (wrong outputs, same shapes), i.e. the throughput if attention were free. It bounds what a faster attention could give;
  * the same kind of bound for the small ops: native tokens/s with every RMSNorm and the MLP activation replaced by
    the identity (wrong outputs, same shapes and matmuls). The profiler's self-CPU share of these ops overstates
    them (its per-op cost is larger than theirs); this measures what fusing them could give;
  * wall seconds of one generate call by stage: the prefill (chunked_prefill), the decode attention
    (kv_cache.decode_attention or the kernel) and the rest of the decode loop (layer matmuls, norms, sampling, bookkeeping);
    this and the two diagnostics above replace the attention call, so in fp32 they time the eager step's layers
    (cpu_decode_layer.py's driver calls the attention kernel from C and is then not used);
  * wall seconds of one generate call inside the engine's C kernels (cpu_linear.py, cpu_attention.py,
    cpu_step_ops.py, and cpu_decode_layer.py's driver, which calls the others itself: timed around their ctypes
    calls), per kernel, and the rest of the call: the Python, the torch ops between the kernels, sampling and
    bookkeeping. With ``--n`` > 1 each prompt is sampled n times (GRPO's
    shape; the rollout decodes batch * n rows over batch prompts' shared KV);
  * in fp32, generate calls with cpu_decode_layer.py's driver on and off, alternated (``layer_driver_ab``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rollout_throughput import git_commit, make_prompts, matmul_floor
from hybridflow import device
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.engines.tiny import TINY_ARCHITECTURES, write_tiny_model

GROUPS = {
    # the oneDNN-packed fp32/bf16 matmuls (onednn_linear.py) are mkldnn::_linear_pointwise, the panel kernel's
    # (cpu_linear.py) hybridflow::panel_linear
    "layer_matmuls": ("aten::mm", "aten::addmm", "quantized::linear_dynamic", "mkldnn::_linear_pointwise",
                      "hybridflow::panel_linear"),
    "attention_matmuls": ("aten::bmm", "aten::baddbmm", "hybridflow::cpu_decode_attention"),
}


def tokens_per_s(engine, prompts, params, repeats: int) -> float:
    engine.generate(prompts, params)  # warm-up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        best = max(best, int(out.batch["response_mask"].sum()) / (time.perf_counter() - start))
    return round(best, 1)


def profile_shares(engine, prompts, params) -> dict:
    from torch.profiler import profile

    with profile() as prof:
        engine.generate(prompts, params)
    totals = defaultdict(float)
    for event in prof.key_averages():
        group = next((g for g, names in GROUPS.items() if event.key in names), "other")
        totals[group] += event.self_cpu_time_total
    whole = sum(totals.values())
    return {group: round(t / whole, 3) for group, t in sorted(totals.items())}


def matmul_seconds_per_step(engine, prompts, params) -> float:
    decoder = engine.model
    original, spent = decoder._linear, [0.0]

    def timed(li, name, x):
        start = time.perf_counter()
        out = original(li, name, x)
        spent[0] += time.perf_counter() - start
        return out

    decoder._linear = timed
    try:
        engine.generate(prompts, params)
    finally:
        del decoder._linear  # back to the class's method
    return round(spent[0] / params.max_new_tokens, 4)


def stage_seconds(engine, prompts, params) -> dict:
    """Wall seconds of one generate call in the prefill, in decode attention, and in the rest."""
    from hybridflow.engines.rollout import native_model, native_rollout

    spent = defaultdict(float)

    def timed(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return original, wrapper

    patches = [(native_rollout, "chunked_prefill"), (native_model, "decode_attention")]
    kernel = engine.model.attention_kernel
    if kernel is not None:  # the CPU kernel (cpu_attention.py): timed under the same name
        patches.append((_Wrapped(kernel), "decode_attention"))
        engine.model.attention_kernel = patches[-1][0]
    originals = []
    for module, name in patches:
        original, wrapper = timed(module, name)
        originals.append(original)
        setattr(module, name, wrapper)
    try:
        start = time.perf_counter()
        engine.generate(prompts, params)
        whole = time.perf_counter() - start
    finally:
        for (module, name), original in zip(patches, originals):
            setattr(module, name, original)
        engine.model.attention_kernel = kernel
    prefill, attention = spent["chunked_prefill"], spent["decode_attention"]
    return {"generate": round(whole, 4), "prefill": round(prefill, 4), "decode_attention": round(attention, 4),
            "rest": round(whole - prefill - attention, 4)}


class _Wrapped:
    """An attention kernel whose call can be replaced (timed, or zeroed) while supports/starts stay the kernel's."""

    def __init__(self, kernel, call=None):
        self.kernel = kernel
        self.decode_attention = call or kernel.__call__
        self.supports, self.starts = kernel.supports, kernel.starts

    def __call__(self, *args, **kwargs):
        return self.decode_attention(*args, **kwargs)


def without_attention(engine, prompts, params, repeats: int) -> float:
    real_bmm, real_baddbmm = torch.bmm, torch.baddbmm
    torch.bmm = lambda a, b: a.new_zeros(a.shape[0], a.shape[1], b.shape[2])
    torch.baddbmm = lambda bias, a, b, alpha=1.0: a.new_zeros(a.shape[0], a.shape[1], b.shape[2])
    kernel = engine.model.attention_kernel
    if kernel is not None:
        engine.model.attention_kernel = _Wrapped(kernel, lambda q, *args, **kwargs: torch.zeros_like(q))
    try:
        return tokens_per_s(engine, prompts, params, repeats)
    finally:
        torch.bmm, torch.baddbmm = real_bmm, real_baddbmm
        engine.model.attention_kernel = kernel


def without_norms_and_activation(engine, prompts, params, repeats: int) -> float:
    from hybridflow.engines.rollout import native_model

    decoder = engine.model
    real_norm, real_act = native_model._rms_norm, decoder.act
    native_model._rms_norm = lambda x, weight, eps, offset: x
    decoder.act = lambda x: x
    try:
        return tokens_per_s(engine, prompts, params, repeats)
    finally:
        native_model._rms_norm, decoder.act = real_norm, real_act


def kernel_seconds(engine, prompts, params) -> dict | None:
    """Wall seconds of one generate call inside each C kernel of the native engine, and the rest; None when the
    engine runs none (oneDNN projections, torch attention)."""
    decoder = engine.model
    spent: dict[str, float] = defaultdict(float)
    patches = []  # (holder, key, original): holder is an object (attribute key) or a dict (item key)

    def timed(name, function):
        def call(*args):
            start = time.perf_counter()
            try:
                return function(*args)
            finally:
                spent[name] += time.perf_counter() - start
        return call

    def patch(holder, key, name):
        original = holder[key] if isinstance(holder, dict) else getattr(holder, key)
        patches.append((holder, key, original))
        if isinstance(holder, dict):
            holder[key] = timed(name, original)
        else:
            setattr(holder, key, timed(name, original))

    if decoder.panel_kernel is not None:
        patch(decoder.panel_kernel, "_function", "panel_linear")
    if decoder.attention_kernel is not None:
        for dtype in list(decoder.attention_kernel._functions):
            patch(decoder.attention_kernel._functions, dtype, "decode_attention")
    if decoder.layer_kernel is not None:  # cpu_decode_layer.py: its C driver calls the kernels below itself
        patch(decoder.layer_kernel, "_attention", "decode_layer")
        patch(decoder.layer_kernel, "_mlp_out", "decode_layer")
    if decoder.step_ops is not None:
        patch(decoder.step_ops, "_rms", "rms_norm")
        patch(decoder.step_ops, "_rms_f32", "rms_norm")
        for dtype in list(decoder.step_ops._rope):
            patch(decoder.step_ops._rope, dtype, "rotary")
    if not patches:
        return None
    try:
        start = time.perf_counter()
        engine.generate(prompts, params)
        whole = time.perf_counter() - start
    finally:
        for holder, key, original in reversed(patches):
            if isinstance(holder, dict):
                holder[key] = original
            else:
                setattr(holder, key, original)
    inside = sum(spent.values())
    return {"generate": round(whole, 4), **{k: round(v, 4) for k, v in sorted(spent.items())},
            "outside_kernels": round(whole - inside, 4), "outside_share": round(1 - inside / whole, 3)}


def layer_driver_ab(engine, prompts, params, rounds: int) -> dict | None:
    """Generate calls with cpu_decode_layer.py's driver on and off, alternated (A B B A ...): median seconds of
    each, their ratio, and whether the two gave the same tokens and log-probs (they must); None without the driver."""
    decoder = engine.model
    driver = decoder.layer_kernel
    if driver is None or not driver.applies(decoder):
        return None
    times, outputs = {"on": [], "off": []}, {}
    params = dataclasses.replace(params, seed=0)  # the same draws in every call, so the outputs compare
    try:
        for r in range(rounds + 1):  # round 0 warms both up
            for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
                decoder.layer_kernel = driver if name == "on" else None
                start = time.perf_counter()
                outputs[name] = engine.generate(prompts, params)
                if r:
                    times[name].append(time.perf_counter() - start)
    finally:
        decoder.layer_kernel = driver
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    same = all(torch.equal(outputs["on"].batch[k], outputs["off"].batch[k])
               for k in ("responses", "rollout_log_probs"))
    return {"median_s_on": round(median["on"], 4), "median_s_off": round(median["off"], 4),
            "on_over_off": round(median["on"] / median["off"], 3), "rounds": rounds, "same_outputs": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="int8,fp32")
    parser.add_argument("--batch", type=int, default=64, help="distinct prompts")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (decode rows = batch * n)")
    parser.add_argument("--arch", default="qwen2", choices=TINY_ARCHITECTURES, help="architecture of the model")
    parser.add_argument("--size", default="mid", choices=["tiny", "small", "mid"], help="engines/tiny.py's SIZES")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ab-rounds", type=int, default=6, help="rounds of the layer driver's on/off A/B")
    args = parser.parse_args()
    device.set_num_threads(args.threads)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.n)
    rows = args.batch * args.n
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(os.path.join(tmp, args.size), args.size, seed=0, arch=args.arch)
        hf = create_rollout_engine("hf", path, dtype="fp32", num_threads=args.threads)
        prompts = make_prompts(hf.tokenizer, args.batch, 16, 32, seed=args.batch)
        results["hf_fp32_tokens_per_s"] = tokens_per_s(hf, prompts, params, args.repeats)
        del hf
        for dtype in args.dtypes.split(","):
            engine = create_rollout_engine("native", path, dtype=dtype, num_threads=args.threads)
            row = {"tokens_per_s": tokens_per_s(engine, prompts, params, args.repeats)}
            row["profile_self_cpu_share"] = profile_shares(engine, prompts, params)
            row["layer_matmul_seconds_per_step"] = matmul_seconds_per_step(engine, prompts, params)
            row["stage_seconds"] = stage_seconds(engine, prompts, params)
            row["kernel_seconds"] = kernel_seconds(engine, prompts, params)
            row["layer_driver_ab"] = layer_driver_ab(engine, prompts, params, args.ab_rounds)
            # the same matmuls (plus the output head) alone, on their own: rollout_throughput.py's floor
            row["matmul_floor_seconds_per_step"] = round(rows / matmul_floor(args.size, dtype, rows), 4)
            row["tokens_per_s_if_attention_were_free"] = without_attention(engine, prompts, params, args.repeats)
            row["tokens_per_s_if_norms_and_activation_were_free"] = without_norms_and_activation(
                engine, prompts, params, args.repeats)
            row["tokens_per_s_again"] = tokens_per_s(engine, prompts, params, args.repeats)  # drift over the run
            results[f"native_{dtype}"] = row
            print(json.dumps({dtype: row}), file=sys.stderr)
    doc = {
        "benchmark": "rollout_profile",
        "git_commit": git_commit(),
        "config": {"size": args.size, "arch": args.arch, "batch": args.batch, "new_tokens": args.new_tokens, "threads": args.threads,
                   "prompt_len": [16, 32], "samples_per_prompt": args.n},
        "load_average": os.getloadavg(),
        "results": results,
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
