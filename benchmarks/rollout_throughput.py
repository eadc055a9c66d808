"""New tokens per second of the rollout engines on the ~21M-parameter "mid" model (any --arch of make-tiny-model);
prints one JSON document.

    .venv/bin/python benchmarks/rollout_throughput.py                 # batch 1/16/64/256, fp32 and bf16, hf + native
    .venv/bin/python benchmarks/rollout_throughput.py --quick         # batch 16/64 only, one repeat
    .venv/bin/python benchmarks/rollout_throughput.py --backends hf,native,vllm   # runs itself in .venv-vllm
    .venv/bin/python benchmarks/rollout_throughput.py --dtypes fp32,int8   # int8: native engine, CPU
    .venv/bin/python benchmarks/rollout_throughput.py --n 8 --prompt-len 240,256 --batch-sizes 64   # GRPO-like
    python benchmarks/rollout_throughput.py --backends hf,native,native:eager   # GPU: CUDA graphs vs eager decode
    .venv/bin/python benchmarks/rollout_throughput.py --backends hf,native,native:compiled   # CPU: compiled step
    .venv/bin/python benchmarks/rollout_throughput.py --backends hf,native,native:prepack=false   # CPU: oneDNN packing
    .venv/bin/python benchmarks/rollout_throughput.py --arch gemma3_text --dtypes fp32 --batch-sizes 64   # one arch
    .venv/bin/python benchmarks/rollout_throughput.py --model DIR --dtypes fp32 --batch-sizes 32,64    # a real model
    .venv/bin/python benchmarks/rollout_throughput.py --model DIR --top-p 0.9 --n 4 --batch-sizes 64   # nucleus
    .venv/bin/python benchmarks/rollout_throughput.py --backends hf,native,native:attention_kernel=false --interleave
    .venv/bin/python benchmarks/rollout_throughput.py --backends native,native:linear_kernel=false --interleave

Sampling at temperature 1 (with --top-p / --top-k when given, for every backend) with the model's eos active:
tokens/s counts the tokens actually generated (response_mask), and each configuration reports the best of --repeats
runs after one warm-up call. --interleave times the backends' calls in turns (their best and every call's rate are
reported), instead of one backend's repeats after another's.

For a dense --size model, ``matmul_floor`` gives two ceilings per dtype and batch size, the weight matmuls alone with
the native engine's kernels: a decode step's (``matmul_floor_new_tokens_per_s``) and a whole call's, the prefill of
its prompt tokens and then --new-tokens decode steps (``matmul_floor_with_prefill_new_tokens_per_s``). Divided by hf's
rate (``speedups``), they bound what any engine with these kernels could be over hf here.

vLLM lives in its own virtualenv (.venv-vllm, `make vllm-env`: its pins differ from the main venv's). Asked for the
vllm backend where vLLM is not installed, the script builds that venv if it is missing (scripts/setup_vllm_env.sh,
idempotent) and runs itself again there, with the same arguments: every backend of the run then runs in that venv
(the same torch; ``versions`` in the JSON says which interpreter and transformers ran). --no-vllm-venv reports the
missing vLLM in ``errors`` instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

# vLLM logs to stdout by default, which would break the one JSON document this script prints there
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridflow import device
from hybridflow.engines.rollout import SamplingParams, cpu_linear, create_rollout_engine
from hybridflow.engines.rollout.onednn_linear import onednn_available, onednn_linear, pack_onednn
from hybridflow.engines.tiny import SIZES, TINY_ARCHITECTURES, write_tiny_model
from hybridflow.protocol import DataProto

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_VENV = os.path.join(ROOT, ".venv-vllm")
VLLM_VENV_PYTHON = os.path.join(VLLM_VENV, "bin", "python")


def git_commit() -> str | None:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def rerun_in_vllm_venv(backends: list[str]) -> None:
    """When a vllm backend is asked for and vLLM is not importable here: build .venv-vllm if needed and replace this
    process by the same command under its python (no return). A no-op where vLLM imports, or with no vllm backend."""
    if not any(b.split(":")[0] == "vllm" for b in backends) or importlib.util.find_spec("vllm") is not None:
        return
    if os.path.realpath(sys.prefix) == os.path.realpath(VLLM_VENV):
        raise SystemExit(f"{VLLM_VENV_PYTHON} runs this script but cannot import vllm: rebuild that venv with "
                         "`bash scripts/setup_vllm_env.sh --force`")
    if not os.path.exists(VLLM_VENV_PYTHON):
        print("rollout_throughput: vLLM is not installed here; building .venv-vllm (scripts/setup_vllm_env.sh, "
              "a few minutes)", file=sys.stderr)
        # its progress to stderr: stdout carries the one JSON document
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_vllm_env.sh")], check=True, stdout=sys.stderr)
    print(f"rollout_throughput: vLLM is not installed in {sys.executable}; running again under {VLLM_VENV_PYTHON}",
          file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(VLLM_VENV_PYTHON, [VLLM_VENV_PYTHON, os.path.abspath(__file__), *sys.argv[1:]])


def make_prompts(tokenizer, batch: int, min_len: int, max_len: int, seed: int) -> DataProto:
    """`batch` random printable-character prompts of min_len..max_len tokens, left-padded."""
    g = torch.Generator().manual_seed(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?"
    texts = []
    for _ in range(batch):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        texts.append("".join(alphabet[int(i)] for i in torch.randint(len(alphabet), (length,), generator=g)))
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def measure(engine, prompts: DataProto, params: SamplingParams, repeats: int, seed: int = 0) -> dict:
    """The best of `repeats` calls (sampling seeds seed, seed + 1, ...); ``first_call_seconds`` is the first one's wall
    time (with a compiled decode step it includes compiling this batch's shape)."""
    best, first = None, None
    for r in range(seed, seed + repeats):
        device.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(**{**params.__dict__, "seed": r}))
        device.synchronize()
        seconds = time.perf_counter() - start
        tokens = int(out.batch["response_mask"].sum())
        first = seconds if first is None else first
        if best is None or tokens / seconds > best["new_tokens_per_s"]:
            best = {"seconds": round(seconds, 4), "new_tokens": tokens, "new_tokens_per_s": round(tokens / seconds, 1)}
    return {**best, "first_call_seconds": round(first, 4)}


def sampling_params(args) -> SamplingParams:
    """Every backend's sampling: temperature 1, --new-tokens, --n samples a prompt, --top-p / --top-k."""
    return SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.n, top_p=args.top_p,
                          top_k=args.top_k)


def run_interleaved(path: str, backends: list[str], dtypes: list[str], batch_sizes: list[int], prompt_len, args,
                    errors: dict) -> list[dict]:
    """--interleave: per dtype, every backend's engine built and warmed up, then per batch size `repeats` rounds in
    which each backend makes one call in turn; each backend's row is its best call (and its first one)."""
    results = []
    params = sampling_params(args)
    for dtype in dtypes:
        engines, warmups = {}, {}
        for backend in backends:
            name, *options = backend.split(":")
            try:
                engine = create_rollout_engine(name, path, dtype=dtype, num_threads=args.threads,
                                               **engine_options(options))
            except (ImportError, ValueError) as err:
                errors[f"{backend}/{dtype}"] = str(err)
                continue
            start = time.perf_counter()
            engine.generate(make_prompts(engine.tokenizer, 4, *prompt_len, seed=99), params)
            engines[backend], warmups[backend] = engine, round(time.perf_counter() - start, 3)
        for batch in batch_sizes:
            if batch % args.n:
                raise SystemExit(f"--batch-sizes: {batch} rows is not a multiple of --n {args.n}")
            calls: dict[str, list[dict]] = {backend: [] for backend in engines}
            for r in range(args.repeats):
                for backend, engine in engines.items():
                    prompts = make_prompts(engine.tokenizer, batch // args.n, *prompt_len, seed=batch)
                    calls[backend].append(measure(engine, prompts, params, 1, seed=r))
            for backend, rows in calls.items():
                best = max(rows, key=lambda row: row["new_tokens_per_s"])
                row = {"backend": backend, "dtype": dtype, "batch": batch, "warmup_seconds": warmups[backend],
                       **best, "first_call_seconds": rows[0]["first_call_seconds"],
                       "all_new_tokens_per_s": [x["new_tokens_per_s"] for x in rows]}
                results.append(row)
                print(json.dumps(row), file=sys.stderr)
        engines.clear()
    return results


def engine_options(options: list[str]) -> dict:
    """'native:eager' -> decode='eager'; 'native:prepack=false' -> prepack=False (any key=value engine kwarg)."""
    kwargs: dict = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            kwargs["decode"] = key
            continue
        kwargs[key] = {"true": True, "false": False}.get(value.lower(), value)
    return kwargs


def _matmul_pass(size: str, dtype: str, rows: int, head_rows: int | None = None):
    """A callable that runs the model's weight matmuls once (q/k/v/o and the MLP of every layer over `rows` rows, the
    output head over `head_rows`, default `rows`) with the native engine's kernels; see matmul_floor."""
    spec = SIZES[size]
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    h, inter = spec.hidden_size, spec.intermediate_size or 4 * spec.hidden_size
    kv = h // spec.num_heads * spec.num_kv_heads
    shapes = [(h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter)] * spec.num_layers + [(spec.vocab_size, h)]
    weights = [torch.randn(o, i, dtype=torch_dtype, device=device.current_device()) * 0.02 for o, i in shapes]
    xs = {i: torch.randn(rows, i, dtype=torch_dtype, device=device.current_device()) for _, i in shapes}
    head_x = xs[h] if head_rows is None else xs[h][:head_rows].contiguous()
    inputs = [xs[w.shape[1]] for w in weights[:-1]] + [head_x]
    if dtype == "int8":
        from hybridflow.engines.rollout.int8_linear import int8_linear, pack_int8

        layers = [pack_int8(w, None) for w in weights[:-1]]

        def step():
            for x, packed in zip(inputs, layers):
                int8_linear(x, packed)
            torch.nn.functional.linear(head_x, weights[-1])
    elif dtype == "fp32" and device.device_name() == "cpu" and onednn_available(torch_dtype) and cpu_linear.load():
        kernel = cpu_linear.load()
        panels = [kernel.pack(w) for w in weights]

        def step():
            for x, p in zip(inputs, panels):
                kernel.linear(x, p, None)
    elif dtype != "int8" and device.device_name() == "cpu" and onednn_available(torch_dtype):
        # the native engine's fp32 CPU matmuls (and bf16 on CPUs with bf16 units) use oneDNN-packed weights
        # (onednn_linear.py): its floor is theirs
        packed = [pack_onednn(w) for w in weights]

        def step():
            for x, p in zip(inputs, packed):
                onednn_linear(x, p, None)
    else:

        def step():
            for x, w in zip(inputs, weights):
                torch.nn.functional.linear(x, w)

    return step


def _best_seconds(fn, calls: int) -> float:
    """The best of three timings of `calls` calls of fn (after one warm-up call): a busy moment must not lower a
    floor."""
    fn()
    best = float("inf")
    for _ in range(3):
        device.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        device.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_floor(size: str, dtype: str, batch: int, steps: int = 20) -> float:
    """New tokens/s if a decode step cost only its weight matmuls (q/k/v/o, MLP, lm_head) at this batch size.

    No engine can beat this on the same device and dtype; it shows how much of a step is the model itself. The
    kernels are the native engine's: for int8 its packed int8 layer matmuls (the output head stays fp32, as there),
    for fp32 on CPU its panel kernel (cpu_linear.py; oneDNN where that cannot be built), for bf16 on CPUs with bf16
    units its oneDNN-packed weights.
    """
    return round(batch * steps / _best_seconds(_matmul_pass(size, dtype, batch), steps), 1)


def prefill_matmul_seconds(size: str, dtype: str, prompt_tokens: int, prompts: int) -> float:
    """Seconds of a prefill's weight matmuls alone: each layer's projections over all `prompt_tokens` prompt tokens
    in one product each, and the output head over the last token of each of the `prompts` prompts (the kernels of
    matmul_floor). Every engine prefills the prompts before the first new token."""
    return _best_seconds(_matmul_pass(size, dtype, prompt_tokens, head_rows=prompts), 1)


def prompt_token_counts(path: str, batch_sizes: list[int], n: int, prompt_len: tuple[int, int]) -> dict[int, int]:
    """Prompt tokens each batch size's call prefills: its batch / n distinct prompts (make_prompts, the seeds the
    measured calls use), each prefilled once however many samples share it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return {batch: int(make_prompts(tokenizer, batch // n, *prompt_len, seed=batch).batch["attention_mask"].sum())
            for batch in batch_sizes if batch % n == 0}


def matmul_ceiling(args: argparse.Namespace, dtype: str, batch: int, prompt_tokens: int) -> dict:
    """The floor row of one dtype and batch size: the decode step's matmuls alone (matmul_floor), and a whole
    call's (its prefill's matmuls, then --new-tokens decode steps for every row) as new tokens/s."""
    rate = matmul_floor(args.size, dtype, batch)
    prefill_s = prefill_matmul_seconds(args.size, dtype, prompt_tokens, batch // args.n)
    call_s = prefill_s + args.new_tokens * batch / rate
    return {"dtype": dtype, "batch": batch, "matmul_floor_new_tokens_per_s": rate, "prompt_tokens": prompt_tokens,
            "prefill_matmul_s": round(prefill_s, 4),
            "matmul_floor_with_prefill_new_tokens_per_s": round(batch * args.new_tokens / call_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="hf,native",
                        help="comma-separated rollout engines (hf,native,vllm); native:MODE sets its decode mode")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, int8 (native engine only)")
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", default="16,32", help="min,max prompt length in tokens")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt: each batch is batch/n prompts x n samples")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for every backend (1.0: off)")
    parser.add_argument("--top-k", type=int, default=-1, help="top-k sampling for every backend (-1: off)")
    parser.add_argument("--size", default="mid", choices=sorted(SIZES))
    parser.add_argument("--arch", default="qwen2", choices=TINY_ARCHITECTURES, help="architecture of the model")
    parser.add_argument("--model", default=None,
                        help="a Hugging Face model folder to use instead of a tiny one (e.g. from `hybridflow import-gguf "
                        "--smollm2 DIR`); no matmul floor is computed for it")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="batch 16 and 64, one repeat")
    parser.add_argument("--interleave", action="store_true",
                        help="build every backend first, then time their calls in turns (A B A B ...), so that a "
                             "machine whose speed drifts during the run biases no backend (not with vllm backends: "
                             "vLLM's CPU thread binding would also bind the other engines of the process)")
    parser.add_argument("--no-vllm-venv", action="store_true",
                        help="where vLLM is not installed, report it in `errors` instead of running again in "
                             ".venv-vllm")
    args = parser.parse_args()
    if args.quick:
        args.batch_sizes, args.repeats = "16,64", 1
    backends = args.backends.split(",")
    if not args.no_vllm_venv:
        rerun_in_vllm_venv(backends)
    dtypes = args.dtypes.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    min_len, max_len = (int(x) for x in args.prompt_len.split(","))
    device.set_num_threads(args.threads)

    results, errors = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or write_tiny_model(os.path.join(tmp, args.size), args.size, seed=0, arch=args.arch)
        # the floor is a dense model's matmuls; a routed-expert model's depend on the routing, so it gets none
        dense = not (args.arch.endswith("_moe") or args.model)
        prompt_tokens = prompt_token_counts(path, batch_sizes, args.n, (min_len, max_len)) if dense else {}
        if args.interleave:
            results = run_interleaved(path, backends, dtypes, batch_sizes, (min_len, max_len), args, errors)
            backends = []  # measured above
        for backend in backends:
            for dtype in dtypes:
                name, *options = backend.split(":")
                kwargs = engine_options(options)
                try:
                    engine = create_rollout_engine(name, path, dtype=dtype, num_threads=args.threads, **kwargs)
                except (ImportError, ValueError) as err:
                    errors[f"{backend}/{dtype}"] = str(err)
                    continue
                params = sampling_params(args)
                start = time.perf_counter()
                engine.generate(make_prompts(engine.tokenizer, 4, min_len, max_len, seed=99), params)  # warm-up
                warmup_seconds = round(time.perf_counter() - start, 3)
                for batch in batch_sizes:
                    if batch % args.n:
                        raise SystemExit(f"--batch-sizes: {batch} rows is not a multiple of --n {args.n}")
                    prompts = make_prompts(engine.tokenizer, batch // args.n, min_len, max_len, seed=batch)
                    row = {"backend": backend, "dtype": dtype, "batch": batch, "warmup_seconds": warmup_seconds}
                    row.update(measure(engine, prompts, params, args.repeats))
                    results.append(row)
                    print(json.dumps(row), file=sys.stderr)
                del engine

    floors = [
        matmul_ceiling(args, dtype, batch, prompt_tokens[batch]) for dtype in dtypes for batch in batch_sizes if dense
    ]
    speedups = {}
    for row in results:
        if row["backend"] == "hf":
            continue
        ref = next((r for r in results if r["backend"] == "hf" and r["dtype"] == row["dtype"] and r["batch"] == row["batch"]), None)
        if ref is not None:
            speedups[f"{row['backend']}/{row['dtype']}/batch{row['batch']}_vs_hf"] = round(
                row["new_tokens_per_s"] / ref["new_tokens_per_s"], 2
            )
        ref32 = next((r for r in results if r["backend"] == "hf" and r["dtype"] == "fp32" and r["batch"] == row["batch"]), None)
        if ref32 is not None and row["dtype"] != "fp32":
            speedups[f"{row['backend']}/{row['dtype']}/batch{row['batch']}_vs_hf_fp32"] = round(
                row["new_tokens_per_s"] / ref32["new_tokens_per_s"], 2
            )
    # The most any engine using these matmul kernels could be over hf: decode steps that are only their weight matmuls
    # (no attention, sampling or bookkeeping) against hf's measured rate, without the prefill (matmul_floor) and with
    # it (matmul_floor_with_prefill: every call prefills its prompts first). A goal above them cannot be met here.
    for floor in floors:
        ref = next((r for r in results if r["backend"] == "hf" and r["dtype"] == floor["dtype"]
                    and r["batch"] == floor["batch"]), None)
        if ref is not None:
            for key in ("matmul_floor", "matmul_floor_with_prefill"):
                speedups[f"{key}/{floor['dtype']}/batch{floor['batch']}_vs_hf"] = round(
                    floor[f"{key}_new_tokens_per_s"] / ref["new_tokens_per_s"], 2)
    import transformers

    doc = {
        "benchmark": "rollout_throughput",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "device": device.device_name(),
            "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "versions": {"python": platform.python_version(), "interpreter": sys.executable, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "git_commit": git_commit(),
        "config": {
            "size": args.size if not args.model else None,
            "model": args.model,
            "arch": args.arch,
            "backends": backends,
            "dtypes": dtypes,
            "batch_sizes": batch_sizes,
            "new_tokens": args.new_tokens,
            "prompt_len": [min_len, max_len],
            "samples_per_prompt": args.n,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "repeats": args.repeats,
            "quick": args.quick,
            "interleave": args.interleave,
            "sampling": "temperature 1.0, eos active; new tokens counted from response_mask",
        },
        "results": results,
        "speedups": speedups,
        "matmul_floor": floors,
        "errors": errors,
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
