"""Shared by the RL-level benchmarks (rl_step_vs_trl.py, scaling.py, overheads.py): the JSON header, the benchmark
model, the overrides of a small GRPO run, reading its per-stage timings, a least-squares fit and worker peak memory.

Every benchmark prints one JSON document: ``{"benchmark", "machine", "versions", "git_commit", "config", "results"}``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_LOAD_AT_START = os.getloadavg()  # other processes on a shared machine: the main source of noise

# The per-stage timings RLTrainer logs as ``timing/<stage>`` (seconds), in dataflow order.
STAGES = ("generate", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "sync_weights")


# ----------------------------------------------------------------------------------------------------- JSON header
def git_commit() -> dict:
    def git(*args: str) -> str | None:
        try:
            return subprocess.check_output(["git", *args], cwd=ROOT, text=True, stderr=subprocess.DEVNULL).strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "short": git("rev-parse", "--short", "HEAD"), "dirty": bool(status)}


def machine_info() -> dict:
    import psutil

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_at_start": [round(x, 2) for x in _LOAD_AT_START],
        "cpu_flags": cpu_flags(),
    }


# CPU feature flags that decide which matmul kernels run (and whether bf16 is native or emulated).
_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> dict:
    """The matmul-relevant flags of /proc/cpuinfo (Linux), the CPU model, and ``native_bf16``: True when the CPU
    has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16), so bf16 matmuls are not emulated in fp32."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    present = {name: name in flags for name in _FLAGS}
    return {"model": model, **present, "native_bf16": present["avx512_bf16"] or present["amx_bf16"]}


def versions(*modules: str) -> dict:
    out = {"python": platform.python_version()}
    for name in modules:
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    return out


def document(benchmark: str, config: dict, results: dict, extra_versions: Iterable[str] = ()) -> dict:
    doc = {
        "benchmark": benchmark,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "versions": versions("torch", "transformers", "ray", *extra_versions),
        "git_commit": git_commit(),
        "config": config,
        "results": results,
    }
    doc["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return doc


def emit(doc: dict, out: str | None = None) -> None:
    """The document on stdout, and also in the file `out` when given."""
    print(json.dumps(doc, indent=2, default=str))
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=2, default=str)


def run_ranks(target, world: int, *args) -> dict[int, dict]:
    """`target(rank, port, *args, queue)` in `world` spawned processes (a torch.distributed world on a free port);
    each puts ``(rank, result)`` on the queue. Returns {rank: result}; RuntimeError if a process failed."""
    import torch.multiprocessing as mp

    from hybridflow.common.ports import find_free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"rank process exited with {p.exitcode}")
    return per_rank


class StdoutToStderr:
    """Sends everything written to file descriptor 1 (Ray's forwarded worker logs, progress bars) to stderr while
    active, so that stdout carries exactly one JSON document, written by `emit`."""

    def __enter__(self) -> StdoutToStderr:
        sys.stdout.flush()
        self._saved = os.dup(1)
        os.dup2(2, 1)
        return self

    def emit(self, doc: dict) -> None:
        sys.stdout.flush()
        os.write(self._saved, (json.dumps(doc, indent=2, default=str) + "\n").encode())

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        os.dup2(self._saved, 1)
        os.close(self._saved)


def log(*parts: object) -> None:
    """Progress goes to stderr so stdout stays one JSON document."""
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------- statistics
def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ms_per_call(fn, calls: int, repeats: int) -> float:
    """Milliseconds per call of fn(): the median over `repeats` timings of `calls` calls each, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return round(1e3 * median(times), 4)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict:
    """Least squares ``y = slope * x + intercept`` and the coefficient of determination R^2."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"slope": slope, "intercept": intercept, "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0}


# ----------------------------------------------------------------------------------------------------- the model
def write_benchmark_model(path: str, size: str, seed: int = 0, unreachable_eos: bool = True) -> str:
    """A random-init Qwen2 of `size` (hybridflow.engines.tiny.SIZES) plus the character tokenizer, written to `path`.

    With `unreachable_eos`, the eos token is moved to an id the model cannot emit (ids past the tokenizer's 260
    characters are filled with unused special tokens up to the model's vocabulary, and eos is the next id): every
    framework then generates exactly max_new_tokens per sample, so the work per step is equal and known. Text encodes
    exactly as with the stock tokenizer (same ids for every character and for the chat template's markers).
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from hybridflow.engines.tiny import write_tiny_model

    write_tiny_model(path, size, seed=seed)
    if not unreachable_eos:
        return path
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fillers = [f"<|unused_{i}|>" for i in range(config.vocab_size - len(tokenizer))]
    tokenizer.add_special_tokens({"additional_special_tokens": fillers})
    tokenizer.add_special_tokens({"eos_token": "<|unreachable_eos|>"})
    eos = tokenizer.eos_token_id
    if eos < config.vocab_size:
        raise RuntimeError(f"eos id {eos} is inside the model's vocabulary ({config.vocab_size}): it could be sampled")
    tokenizer.save_pretrained(path)
    config.eos_token_id = eos
    config.save_pretrained(path)
    gen = GenerationConfig.from_pretrained(path)
    gen.eos_token_id = eos
    gen.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------------- hybridflow runs
def task_subset(workdir: str, rows: int) -> str:
    """The first `rows` prompts of the built-in arithmetic task's train.parquet, as a parquet file in `workdir`.

    A run of a few steps needs only a few prompts; a small file keeps the dataset's start-up tokenization (20,000
    chat-templated prompts otherwise) out of the benchmark's wall time. Rows keep the file order of the original.
    """
    import pyarrow.parquet as pq

    from hybridflow.data.builtin import ensure_builtin_task_files

    path = os.path.join(workdir, f"arithmetic_first_{rows}.parquet")
    if not os.path.exists(path):
        train, _ = ensure_builtin_task_files()
        pq.write_table(pq.read_table(train).slice(0, rows), path)
    return path


# bf16 in hybridflow: bf16 compute over fp32 master weights in training (as TRL's bf16=True autocast), bf16 rollout.
BF16_OVERRIDES = (
    "actor_rollout_ref.actor.fsdp_config.param_dtype=bf16",
    "actor_rollout_ref.ref.fsdp_config.param_dtype=bf16",
    "actor_rollout_ref.rollout.dtype=bf16",
)


def grpo_overrides(
    *,
    model_path: str,
    run_dir: str,
    prompts_per_step: int,
    n: int,
    max_response_length: int,
    steps: int,
    threads: int = 2,
    backend: str = "ray",
    kl_coef: float = 0.04,
    lr: float = 1e-6,
    max_prompt_length: int = 64,
    extra: Sequence[str] = (),
) -> list[str]:
    """`hybridflow train` overrides for a GRPO run of `steps` steps on the first prompts of the built-in arithmetic
    task (in file order: data.shuffle=false).

    One optimizer step per training step over all prompts_per_step * n responses (one micro-batch), the KL loss
    (low_var_kl, coefficient kl_coef) against the frozen reference, no validation, no checkpoints, JSONL metrics.
    """
    data = task_subset(os.path.dirname(run_dir), prompts_per_step * (steps + 1))
    rows = prompts_per_step * n
    return [
        f"data.train_files={data}", f"data.val_files={data}", "data.shuffle=false",
        f"actor_rollout_ref.model.path={model_path}",
        f"data.train_batch_size={prompts_per_step}", f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={max_response_length}", "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.name=native",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts_per_step}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={rows}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={rows}",
        f"actor_rollout_ref.actor.optim.lr={lr}", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.use_kl_loss=true", f"actor_rollout_ref.actor.kl_loss_coef={kl_coef}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0.0",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.logger=[jsonl]",
        "trainer.progress_bar=false", "reward_model.num_workers=1", f"trainer.num_threads_per_worker={threads}",
        f"trainer.backend={backend}", "trainer.n_gpus_per_node=1", "trainer.device=cpu",
        *extra,
    ]


def run_inprocess(overrides: Sequence[str]) -> list[dict]:
    """`hybridflow train <overrides>` in this process (Ray, once started, is reused by later runs); the step rows."""
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main import run_training

    cfg = load_config(list(overrides))
    run_training(cfg, progress=False)
    return read_metrics(cfg.trainer.default_local_dir)


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of run_dir/metrics.jsonl that carry a training step (timing/step), in step order."""
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                row = row.get("metrics", row) | {"step": row.get("step", row.get("training/global_step"))}
                if "timing/step" in row:
                    rows.append(row)
    return rows


def stage_breakdown(rows: Sequence[dict]) -> dict:
    """Median seconds per stage over `rows`, plus each stage's share of the median step."""
    step = median([r["timing/step"] for r in rows])
    out = {"step_s": round(step, 4)}
    for stage in STAGES:
        values = [r[f"timing/{stage}"] for r in rows if f"timing/{stage}" in r]
        if values:
            out[f"{stage}_s"] = round(median(values), 4)
    accounted = sum(v for k, v in out.items() if k != "step_s")
    out["other_s"] = round(step - accounted, 4)  # driver work between the timed stages (balance, metrics, unions)
    return out


# ----------------------------------------------------------------------------------------------------- memory
def _peak_rss_kb(pid: int) -> int | None:
    """The kernel's high-water mark of a process's resident memory (VmHWM), in kB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemoryMonitor:
    """Records the peak resident memory of this process and of every Ray worker process below it.

    Ray's worker processes are descendants of the driver (driver -> raylet -> workers) and are named ``ray::<Class>``;
    VmHWM is a kernel high-water mark, so sampling every `interval_s` loses no peak of a process seen at least once.
    """

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.peaks_kb: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemoryMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        import psutil

        me = psutil.Process()
        procs = [(me.pid, "driver")]
        try:
            for child in me.children(recursive=True):
                try:
                    # Ray renames its workers' command lines "ray::<Class>.<method>" (comm is cut at 15 chars).
                    name = (child.cmdline() or [child.name()])[0].split(".")[0]
                    if name.startswith("ray::") and not name.endswith(("IDLE", "Agent")):  # not Ray's own agents
                        procs.append((child.pid, name))
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        for pid, name in procs:
            kb = _peak_rss_kb(pid)
            if kb is not None:
                self.peaks_kb[pid] = (name, max(self.peaks_kb.get(pid, (name, 0))[1], kb))

    def report(self) -> list[dict]:
        return [
            {"pid": pid, "process": name, "peak_rss_mb": round(kb / 1024, 1)}
            for pid, (name, kb) in sorted(self.peaks_kb.items(), key=lambda kv: -kv[1][1])
        ]
