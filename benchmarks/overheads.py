"""What a hybridflow GRPO step spends outside the model math; prints one JSON document.

    .venv/bin/python benchmarks/overheads.py --quick      # tiny + mid, 4 steps each (1 warm-up)
    .venv/bin/python benchmarks/overheads.py              # tiny + mid, 6 steps each
    .venv/bin/python benchmarks/overheads.py --backend local --ranks 1

Per model size, one `hybridflow train` run (in this process) of GRPO with the KL loss on the built-in arithmetic task,
with the stock tokenizer (eos active, so response lengths vary as in real runs), instrumented from the outside:

  * weight sync: ``timing/sync_weights`` / ``timing/step`` (goal <= 5%). In the hybrid engine this is the actor's
    FSDP2 parameters copied one full tensor at a time into the rollout engine's fused weights.
  * padding waste (goal <= 10%): of the tokens the training forward/backward computes, the share that is padding.
    The step's real batch is planned exactly as the engine plans it (hybridflow.engines.micro_batch: rows stripped to
    their real tokens, sorted, fixed-size micro-batches; and the token-budget planner of use_dynamic_bsz); the plain
    padded [rows, prompt + response] layout (what an unpadded-unaware trainer computes) is shown for contrast, and
    so is the padding of the rollout's right-padded responses (an upper bound of decode work on finished rows).
  * single-controller dispatch overhead: every group call is timed in the driver (WorkerGroup._call) and inside the
    worker (the worker class is a subclass whose registered methods time themselves); overhead = driver time - the
    slowest rank's time inside the method, i.e. splitting, padding, serialising, shipping, waiting and concatenating.
    Its sum over a step's calls / the step is the dispatch share. A no-op call that ships the step's whole batch to
    the workers and back, and one with a single row, give the transfer cost and the fixed cost of a call.
Medians over the steps after warm-up.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    StdoutToStderr,
    document,
    grpo_overrides,
    log,
    median,
    run_inprocess,
    stage_breakdown,
    write_benchmark_model,
)

from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, register
from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

# The worker methods the RL step calls, timed from inside the worker.
TIMED_METHODS = (
    "generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor", "sync_rollout_weights",
)


def _timed(name: str):
    original = getattr(ActorRolloutRefWorker, name)

    @functools.wraps(original)  # keeps the @register spec (it lives in the function's __dict__)
    def method(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            self.__dict__.setdefault("_bench_inner", []).append((name, time.perf_counter() - start))

    return method


class TimedActorRolloutRefWorker(ActorRolloutRefWorker):
    """ActorRolloutRefWorker whose step methods record their own duration; defined in __main__, so Ray ships the
    class by value to the worker processes."""

    generate_sequences = _timed("generate_sequences")
    compute_log_prob = _timed("compute_log_prob")
    compute_ref_log_prob = _timed("compute_ref_log_prob")
    update_actor = _timed("update_actor")
    sync_rollout_weights = _timed("sync_rollout_weights")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def bench_report(self) -> dict:
        """(method, seconds) pairs since the last report, and this process's peak resident memory."""
        inner, self._bench_inner = self.__dict__.get("_bench_inner", []), []
        return {"inner": inner, "pid": os.getpid(), "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def bench_noop(self, data: DataProto) -> DataProto:
        return data


class Instrument:
    """Patches the driver: times group calls and, after each train step, measures padding and no-op round trips."""

    def __init__(self, noop_repeats: int):
        self.noop_repeats = noop_repeats
        self.calls: list[tuple[str, float]] = []
        self.steps: list[dict] = []
        self.recording = True

    def install(self) -> None:
        import hybridflow.trainer.placement as placement
        from hybridflow.single_controller.worker_group import WorkerGroup
        from hybridflow.trainer.rl_trainer import RLTrainer

        placement.ActorRolloutRefWorker = TimedActorRolloutRefWorker
        original_call, original_step = WorkerGroup._call, RLTrainer.train_step
        instrument = self

        def timed_call(group, method, spec, args, kwargs):
            start = time.perf_counter()
            out = original_call(group, method, spec, args, kwargs)
            if instrument.recording:
                instrument.calls.append((method, time.perf_counter() - start))
            return out

        def train_step(trainer, prompts):
            instrument.calls = []
            metrics, batch = original_step(trainer, prompts)
            instrument.after_step(trainer, metrics, batch)
            return metrics, batch

        WorkerGroup._call = timed_call
        RLTrainer.train_step = train_step

    def after_step(self, trainer, metrics: dict, batch) -> None:
        self.recording = False
        try:
            group = trainer.groups.actor_rollout
            reports = group.bench_report()
            self.steps.append(
                {
                    "step_s": metrics["timing/step"],
                    "dispatch": dispatch_overhead(self.calls, reports),
                    "padding": padding(batch, trainer.cfg, group.world_size),
                    "noop": self.noop(group, batch),
                    "worker_peak_rss_mb": max(r["ru_maxrss_mb"] for r in reports),
                }
            )
        finally:
            self.recording = True

    def noop(self, group, batch: DataProto) -> dict:
        tensors = batch.select(list(batch.batch.keys()), non_tensor_keys=[])
        out = {}
        for label, data in (("whole_batch", tensors), ("one_row_per_rank", tensors[: group.world_size])):
            times = []
            for _ in range(self.noop_repeats):
                start = time.perf_counter()
                group.bench_noop(data)
                times.append(time.perf_counter() - start)
            out[label] = {"median_s": median(times), "bytes": sum(t.numel() * t.element_size() for t in data.batch.values())}
        return out


def dispatch_overhead(calls: list[tuple[str, float]], reports: list[dict]) -> dict:
    """Per method: driver seconds, slowest rank's seconds inside, and the difference (summed over a step's calls)."""
    inner_by_rank = []
    for report in reports:
        per_method = defaultdict(list)
        for name, seconds in report["inner"]:
            per_method[name].append(seconds)
        inner_by_rank.append(per_method)
    out: dict[str, dict] = {}
    seen: dict[str, int] = defaultdict(int)
    for method, driver_s in calls:
        if method not in TIMED_METHODS:
            continue
        k = seen[method]
        seen[method] += 1
        inner = max(r[method][k] for r in inner_by_rank if len(r[method]) > k)
        entry = out.setdefault(method, {"driver_s": 0.0, "inside_worker_s": 0.0, "overhead_s": 0.0})
        entry["driver_s"] += driver_s
        entry["inside_worker_s"] += inner
        entry["overhead_s"] += driver_s - inner
    return out


def padding(batch: DataProto, cfg, world_size: int) -> dict:
    """Padding share of the computed tokens for this step's batch under each layout (rank 0's shard).

    ``configured``: the run's own plan (fixed micro-batches of ppo_micro_batch_size_per_gpu rows, stripped and
    sorted); ``micro_batch_<k>``: the same with k rows; ``token_budget``: use_dynamic_bsz's planner with the default
    budget; ``plain_padded_layout``: every row padded to prompt + response columns, one group (no stripping).
    """
    from hybridflow.engines import micro_batch as mb

    actor = cfg.actor_rollout_ref.actor
    rows_per_rank = len(batch) // world_size
    mask = batch.batch["attention_mask"][:rows_per_rank]  # balance_batch already ordered rows for the ranks
    starts, ends = mb.real_token_spans(mask)
    lengths = (ends - starts).tolist()

    def waste(groups, pad_to=None) -> float:
        return mb.padding_stats(lengths, groups, pad_to=pad_to)["padding_waste"]

    response_mask = batch.batch["response_mask"]
    out = {"configured": waste(mb.fixed_size_micro_batches(lengths, actor.ppo_micro_batch_size_per_gpu))}
    for k in (8, 4):
        if k < rows_per_rank:
            out[f"micro_batch_{k}"] = waste(mb.fixed_size_micro_batches(lengths, k))
    out["token_budget"] = waste(mb.token_budget_micro_batches(lengths, actor.ppo_max_token_len_per_gpu))
    out["plain_padded_layout"] = waste([list(range(len(lengths)))], pad_to=mask.shape[1])
    out["rollout_responses_right_padding"] = 1.0 - float(response_mask.sum()) / response_mask.numel()
    lens = response_mask.sum(-1)
    out.update(
        response_length_mean=float(lens.float().mean()), response_length_min=int(lens.min()),
        response_length_max=int(lens.max()),
    )
    return out


def summarize(instrument: Instrument, rows: list[dict], warmup: int) -> dict:
    steps = instrument.steps[warmup:]
    rows = rows[warmup:]
    step_s = median([s["step_s"] for s in steps])
    breakdown = stage_breakdown(rows)
    methods = sorted({m for s in steps for m in s["dispatch"]})
    per_method = {}
    for m in methods:
        per_method[m] = {
            k: round(median([s["dispatch"][m][k] for s in steps if m in s["dispatch"]]), 5)
            for k in ("driver_s", "inside_worker_s", "overhead_s")
        }
    overhead = median([sum(v["overhead_s"] for v in s["dispatch"].values()) for s in steps])
    calls_s = median([sum(v["driver_s"] for v in s["dispatch"].values()) for s in steps])
    pad = {k: round(median([s["padding"][k] for s in steps]), 4) for k in steps[0]["padding"]}
    sync = breakdown.get("sync_weights_s", 0.0)
    return {
        "median_step_s": round(step_s, 4),
        "breakdown_median_s": breakdown,
        "weight_sync": {
            "sync_s": sync, "share_of_step": round(sync / breakdown["step_s"], 4), "goal": "<= 0.05",
            "met": sync / breakdown["step_s"] <= 0.05,
        },
        "padding_waste": {**pad, "goal": "configured <= 0.10", "met": pad["configured"] <= 0.10},
        "dispatch": {
            "overhead_s": round(overhead, 5),
            "share_of_step": round(overhead / step_s, 4),
            "group_calls_s": round(calls_s, 4),
            "driver_work_outside_calls_s": round(step_s - calls_s, 4),
            "per_method_median": per_method,
            "noop_round_trip_median_s": {
                k: round(median([s["noop"][k]["median_s"] for s in steps]), 5) for k in steps[0]["noop"]
            },
            "noop_payload_bytes": {k: steps[0]["noop"][k]["bytes"] for k in steps[0]["noop"]},
        },
        "worker_peak_rss_mb": round(max(s["worker_peak_rss_mb"] for s in steps), 1),
        "steps_kept": len(steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 steps per size, 1 warm-up, 3 no-op repeats")
    p.add_argument("--sizes", default="tiny,mid")
    p.add_argument("--backend", default="ray", choices=["ray", "local"])
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch (default: the whole batch)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: 2 / ranks)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    noop_repeats = 3 if args.quick else 5
    if args.quick:
        args.steps = 4
    threads = args.threads or max(1, 2 // args.ranks)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    instrument = Instrument(noop_repeats)
    instrument.install()
    results = {}
    with StdoutToStderr() as out, tempfile.TemporaryDirectory(prefix="overheads_") as workdir:
        for size in [s for s in args.sizes.split(",") if s]:
            model_path = write_benchmark_model(os.path.join(workdir, f"model_{size}"), size, unreachable_eos=False)
            run_dir = os.path.join(workdir, f"run_{size}")
            rows_per_rank = args.prompts * args.n // args.ranks
            micro = args.micro_batch or rows_per_rank
            overrides = grpo_overrides(
                model_path=model_path, run_dir=run_dir, prompts_per_step=args.prompts, n=args.n,
                max_response_length=args.response_length, steps=args.steps, threads=threads, backend=args.backend,
                extra=[
                    f"trainer.n_gpus_per_node={args.ranks}",
                    f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                ],
            )
            log(f"overheads: {size}")
            instrument.steps = []
            rows = run_inprocess(overrides)
            results[size] = summarize(instrument, rows, args.warmup)
        config = {
            "quick": args.quick, "sizes": args.sizes.split(","), "backend": args.backend, "ranks": args.ranks,
            "threads_per_rank": threads, "prompts_per_step": args.prompts, "samples_per_prompt": args.n,
            "max_response_length": args.response_length, "micro_batch_rows": args.micro_batch or "whole batch per rank",
            "steps": args.steps, "warmup_steps_dropped": args.warmup, "noop_repeats": noop_repeats,
            "model": "random-init Qwen2 with the stock character tokenizer (eos active: response lengths vary)",
            "algorithm": "GRPO, KL loss 0.04 (low_var_kl), one optimizer step per step, fp32, rollout native",
        }
        out.emit(document("overheads", config, results))


if __name__ == "__main__":
    main()
