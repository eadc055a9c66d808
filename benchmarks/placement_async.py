"""Rollout placement and modes on the main job, and weight-transfer time vs model size; prints one JSON document.

    .venv/bin/python benchmarks/placement_async.py --quick            # 12 steps per mode, transfer: tiny + small
    .venv/bin/python benchmarks/placement_async.py --steps 40         # longer runs
    .venv/bin/python benchmarks/placement_async.py --modes one_step_off,disaggregated_sync --skip-transfer

Jobs: ``--job main`` (default) the main job's preset hybridflow/config/arithmetic_grpo.yaml: GRPO, 64 prompts x 8
samples per step, at most 16 response tokens (about 9 on average), validation mean@4 on 256 held-out prompts before
and after; generation is about a tenth of its step. ``--job gen_heavy``: a random-init "small" model (tiny.SIZES)
whose eos cannot be sampled, 8 prompts x 4 samples x exactly 64 tokens, KL loss: generation is about half the step,
where overlapping it can show. Modes (each run a fresh process and Ray cluster):
  * colocated_sync_1rank / _2ranks  the hybrid engine: each process hosts actor + rollout; 1 or 2 data-parallel ranks
  * disaggregated_sync  one actor process and one rollout process, weights streamed after every update
  * one_step_off        as disaggregated, generation of step k+1 overlapping the update of step k
  * async               as disaggregated, the rollout producing into a buffer of 2 batches, max_staleness 2
  (one_step_off_recompute: one_step_off with the old-log-prob pass, decoupled-PPO style; not run by default)
Runs alternate the mode order round by round. Per mode: the median step time over every run's steps after the first
two, the training loop's wall time (the sum of ``timing/step``), generated tokens/s and training samples/s over it,
the mean time per stage, the weight transfer's time and MB/s, and held-out mean@4 before -> after.

Transfer vs size: an actor group and a rollout group of one rank each (hybridflow.engines.tiny SIZES), ten transfers
of version 1..10 over the transfer group; the median seconds and MB/s (gloo on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, document, emit, log

# Every process gets one torch thread: on a small shared machine more threads per process than cores per process
# makes OpenMP spin and the comparison meaningless. The overlapped modes use the rollout's log-probs as the old
# policy (bypass_mode): with one optimizer step per batch the clip is then around the behaviour policy, and no
# old-log-prob pass is added to the step (the sync modes skip it too, being on-policy).
ONE_THREAD = "trainer.num_threads_per_worker=1"
SEPARATE = ("actor_rollout_ref.hybrid_engine=false", ONE_THREAD)
MODES = {
    "colocated_sync_1rank": [ONE_THREAD],
    "colocated_sync_2ranks": [ONE_THREAD, "trainer.n_gpus_per_node=2"],
    "disaggregated_sync": [*SEPARATE],
    "one_step_off": [*SEPARATE, "trainer.rollout_mode=one_step_off", "algorithm.rollout_correction.bypass_mode=true"],
    "one_step_off_recompute": [*SEPARATE, "trainer.rollout_mode=one_step_off"],
    "async": [*SEPARATE, "trainer.rollout_mode=async", "trainer.max_staleness=2", "trainer.rollout_buffer_batches=2",
              "algorithm.rollout_correction.bypass_mode=true"],
}
DEFAULT_MODES = ("colocated_sync_1rank", "colocated_sync_2ranks", "disaggregated_sync", "one_step_off", "async")
# The generation-heavy job: a random-init model whose eos cannot be sampled, so every sample is exactly
# response_length tokens and generation is about half of a step.
GEN_HEAVY = {"size": "small", "prompts": 8, "n": 4, "response_length": 64}
VAL_KEY = "val/hybridflow/arithmetic/mean@4"  # the main job's held-out accuracy
WARMUP_STEPS = 2  # the first steps of a run (allocations, first packing) are not counted in the medians


def job_overrides(job: str, steps: int, run_dir: str, test_freq: int = 0) -> tuple[list[str], str | None]:
    """(overrides, preset) of the job: the main job, or the generation-heavy one (module docstring)."""
    from hybridflow.trainer.main import BUILTIN_PRESET

    if job == "main":
        return [
            f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq or steps}", "trainer.save_freq=0",
            "trainer.val_before_train=true", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
            f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
        ], BUILTIN_PRESET
    from _common import grpo_overrides, write_benchmark_model

    model = os.path.join(os.path.dirname(run_dir), "gen_heavy_model")
    if not os.path.exists(os.path.join(model, "config.json")):
        write_benchmark_model(model, GEN_HEAVY["size"])
    return grpo_overrides(
        model_path=model, run_dir=run_dir, prompts_per_step=GEN_HEAVY["prompts"], n=GEN_HEAVY["n"],
        max_response_length=GEN_HEAVY["response_length"], steps=steps, threads=1,
    ), None


def run_mode(mode: str, steps: int, run_dir: str, job: str = "main", nodes: int = 1, test_freq: int = 0,
             target: float = 0.0) -> dict:
    """In this (child) process: one training run of `job` under `mode`; its summary.

    nodes=2: a simulated two-node Ray cluster (`ray.cluster_utils.Cluster`, one CPU per node), so a separate rollout
    group lands on the other node than the actor. target > 0 (main job): the training-loop time (sum of
    ``timing/step``) to the first validation whose held-out mean@4 reaches it.
    """
    import ray

    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main import run_training

    cluster = None
    if nodes > 1:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    overrides, preset = job_overrides(job, steps, run_dir, test_freq)
    cfg = load_config([*overrides, *MODES[mode]], preset=preset)
    start = time.perf_counter()
    try:
        result = run_training(cfg, progress=False)
    finally:
        if cluster is not None:
            ray.shutdown()
            cluster.shutdown()
    wall = time.perf_counter() - start
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps_rows = [r for r in rows if "timing/step" in r]
    loop_s = sum(r["timing/step"] for r in steps_rows)
    rows_per_step = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    tokens = sum(r["response_length/mean"] * rows_per_step for r in steps_rows)
    stages = sorted({k for r in steps_rows for k in r if k.startswith("timing/") and k != "timing/step"})

    def acc(metrics: dict) -> dict:
        return {k: v for k, v in metrics.items() if k.startswith("val/") and "/mean@" in k}

    to_target = None  # (step, training-loop seconds up to it) of the first validation at or above the target
    if target > 0:
        elapsed = 0.0
        for r in rows:
            elapsed += r.get("timing/step", 0.0)
            if r.get(VAL_KEY, -1.0) >= target:
                to_target = {"step": r.get("training/global_step", r.get("step")), "train_loop_s": elapsed,
                             "mean@4": r[VAL_KEY]}
                break

    return {
        "mode": mode,
        "overrides": MODES[mode],
        "steps": len(steps_rows),
        "train_loop_s": loop_s,
        "step_s": [r["timing/step"] for r in steps_rows],
        "run_training_wall_s": wall,
        "generated_tokens_per_s": tokens / loop_s,
        "training_samples_per_s": rows_per_step * len(steps_rows) / loop_s,
        "mean_stage_s": {k: statistics.mean(r.get(k, 0.0) for r in steps_rows) for k in stages},
        "weight_transfer_MBps_median": statistics.median(
            [r["perf/weight_transfer_MBps"] for r in steps_rows if "perf/weight_transfer_MBps" in r] or [0.0]),
        "staleness_mean": statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in steps_rows),
        "dropped_stale_samples": steps_rows[-1].get("async/dropped_stale_samples", 0.0),
        "job": job,
        "val_before": acc(result.initial_val),
        "val_after": acc(result.last_metrics),
        "nodes": nodes,
        "to_target": to_target,
        "val_curve": [(r.get("training/global_step", r.get("step")), r[VAL_KEY]) for r in rows if VAL_KEY in r],
    }


def transfer_vs_size(sizes: list[str], workdir: str, repeats: int) -> list[dict]:
    """Actor group -> rollout group transfers of the tiny-model SIZES; median seconds and MB/s per size."""
    import ray

    from hybridflow.engines.tiny import write_tiny_model
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main import resolve_defaults
    from hybridflow.trainer.placement import build_worker_groups
    from hybridflow.trainer.rollout_driver import WeightSync

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    out = []
    try:
        for size in sizes:
            path = write_tiny_model(os.path.join(workdir, size), spec=size, seed=0)
            cfg = resolve_defaults(load_config([
                f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.hybrid_engine=false",
                "trainer.num_threads_per_worker=1", "data.max_prompt_length=32", "data.max_response_length=16",
            ]))
            groups = build_worker_groups(cfg, need_ref=False, need_critic=False, need_rm=False)
            try:
                for g in groups.all():
                    g.init_model()
                sync = WeightSync(groups)
                sync.connect()
                runs = [sync.push(v) for v in range(1, repeats + 1)]
                seconds = [r["timing/weight_transfer"] for r in runs]
                out.append({
                    "size": size, "MB": runs[0]["perf/weight_transfer_MB"], "buckets": runs[0]["weights/buckets"],
                    "bucket_MB": cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes,
                    "seconds_median": statistics.median(seconds), "seconds_min": min(seconds),
                    "MBps_median": statistics.median(r["perf/weight_transfer_MBps"] for r in runs),
                })
                log(f"transfer {size}: {out[-1]}")
            finally:
                groups.shutdown()
    finally:
        ray.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {list(MODES)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--job", choices=("main", "gen_heavy"), default="main")
    p.add_argument("--sizes", default="tiny,small,mid")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="12 steps per mode, 1 round, transfer sizes tiny,small")
    p.add_argument("--skip-transfer", action="store_true")
    p.add_argument("--nodes", type=int, default=1, help="2: a simulated two-node Ray cluster, one CPU per node")
    p.add_argument("--test-freq", type=int, default=0, help="main job: validate every N steps (default: at the end)")
    p.add_argument("--target", type=float, default=0.0,
                   help="main job: report the training-loop time to the first held-out mean@4 >= this")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # child process: run this mode, print its summary
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_mode(args.worker, args.steps, args.run_dir, args.job, args.nodes,
                                              args.test_freq, args.target)))
        return
    steps = 12 if args.quick else args.steps
    sizes = ["tiny", "small"] if args.quick else args.sizes.split(",")
    modes = [m for m in args.modes.split(",") if m]
    if args.quick:
        args.rounds = 1
    results: dict = {"runs": [], "modes": {}, "transfer_vs_size": []}
    with tempfile.TemporaryDirectory(prefix="hf-placement-") as work:
        for round_index in range(args.rounds):
            order = modes if round_index % 2 == 0 else modes[::-1]  # alternate: load drifts hit every mode alike
            for mode in order:
                log(f"round {round_index} mode {mode}: {steps} steps")
                env = {**os.environ, "RAY_ADDRESS": "local"}  # a fresh cluster per run, never another session's
                proc = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--worker", mode, "--steps", str(steps), "--job", args.job,
                     "--run-dir", os.path.join(work, f"{mode}_{round_index}"), "--nodes", str(args.nodes),
                     "--test-freq", str(args.test_freq), "--target", str(args.target)],
                    capture_output=True, text=True, cwd=ROOT, env=env,
                )
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    raise RuntimeError(f"mode {mode} failed:\n{proc.stderr[-3000:]}")
                run = json.loads(lines[-1][len("RESULT "):])
                run["round"] = round_index
                results["runs"].append(run)
                log(f"mode {mode}: loop {run['train_loop_s']:.1f} s")
        if not args.skip_transfer:
            results["transfer_vs_size"] = transfer_vs_size(sizes, work, args.repeats)
    for mode in modes:
        runs = [r for r in results["runs"] if r["mode"] == mode]
        kept = [s for r in runs for s in r["step_s"][WARMUP_STEPS:]]
        results["modes"][mode] = {
            "median_step_s": statistics.median(kept),
            "train_loop_s": [r["train_loop_s"] for r in runs],
            "training_samples_per_s": statistics.median(r["training_samples_per_s"] for r in runs),
            "generated_tokens_per_s": statistics.median(r["generated_tokens_per_s"] for r in runs),
            "val_mean4_before_after": [(r["val_before"].get(VAL_KEY), r["val_after"].get(VAL_KEY)) for r in runs],
            "to_target": [r["to_target"] for r in runs],
        }
    med = {m: v["median_step_s"] for m, v in results["modes"].items()}
    for fast, slow in (("one_step_off", "disaggregated_sync"), ("async", "disaggregated_sync"),
                       ("one_step_off", "colocated_sync_2ranks"), ("one_step_off", "colocated_sync_1rank")):
        if fast in med and slow in med:
            results[f"{fast}_over_{slow}"] = med[fast] / med[slow]
    emit(document("placement_async", {"job": args.job if args.job == "main" else {"gen_heavy": GEN_HEAVY}, "steps": steps, "rounds": args.rounds,
                                       "nodes": args.nodes, "test_freq": args.test_freq, "target": args.target, "modes": {m: MODES[m] for m in modes},
                                       "sizes": sizes, "repeats": args.repeats},
                  results))


if __name__ == "__main__":
    main()
